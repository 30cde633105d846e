/*
 * Checkmate ingress, the part v1model and TNA share: the four tables the
 * controller writes in ingress and their actions, declared once.
 *
 *   check_source        LPM on the source of a Checkmate packet: the port a known
 *                       host's packets come in on (strict uRPF / IP source guard);
 *                       a packet from a known source on another port is dropped
 *                       as DROP_SPOOFED_SOURCE. A source with no entry is not
 *                       checked. Other traffic never looks at this table.
 *   route_ipv4          LPM on the destination: next-hop port and MACs (a router).
 *   lookup_job          job id -> counter slot (slot 0: jobs nobody registered).
 *   replicate_to_shadow (job, ingress port, shard key, next-hop port) -> multicast
 *                       group {next hop (instance 0), shadow (instance = shadow id)}.
 *                       A miss means the port is not enrolled for that job: the
 *                       packet is forwarded, never copied, and counted.
 *
 * Included inside each architecture's control CheckmateIngress
 * (p4src/v1model/include/ingress.p4, p4src/tna/include/ingress.p4), after its
 * counters and its drop(bit<8> reason) action, so every name here is
 * CheckmateIngress.<name> in the P4Info, as before this file existed (the
 * P4Info ids are hashes of those names). The including file provides what the
 * two architectures spell differently:
 *
 *   port_id_t                             the port type (bit<9> / PortId_t)
 *   CHECKMATE_INGRESS_PORT                the packet's ingress port
 *   CHECKMATE_SET_MULTICAST_GROUP(group)  hand the packet to the replication engine
 *   CHECKMATE_REJECT_REPLICATION()        count a tagged packet no entry copies
 *   meta.{next_hop_port, routed, replicated, job_slot, source_known, source_port}
 *
 * and p4src/shared/ingress_apply.p4 holds the steps of the apply block that use
 * these tables. The order of the declarations is the order of the P4Info's
 * tables and actions: keep it (tests/test_p4_program.py compares p4c's P4Info
 * with the committed one byte for byte).
 */
#ifndef CHECKMATE_INGRESS_P4
#define CHECKMATE_INGRESS_P4

    action forward(port_id_t port, bit<48> src_mac, bit<48> dst_mac) {
        meta.next_hop_port = port;
        meta.routed = 1;
        hdr.ethernet.src_addr = src_mac;
        hdr.ethernet.dst_addr = dst_mac;
        hdr.ipv4.ttl = hdr.ipv4.ttl - 1;
    }

    /*
     * Source-address validation, as switches do it (IP source guard, strict
     * uRPF): workers accept ring DATA from their peer's address and port
     * without a MAC (docs/security.md), so any host on the fabric could inject
     * gradients under a worker's address. The controller installs, for every
     * host it routes to, the port that host's packets arrive on; a Checkmate
     * packet from that address on any other port is dropped. A source with no
     * entry is not checked, so an unprogrammed switch still forwards and what
     * is protected is exactly the addresses of known hosts (job members).
     */
    action expect_port(port_id_t port) {
        meta.source_known = 1;
        meta.source_port = port;
    }

    action source_unknown() {
        meta.source_known = 0;
    }

    table check_source {
        key = {
            hdr.ipv4.src_addr : lpm @name("src_addr");
        }
        actions = {
            expect_port;
            source_unknown;
        }
        default_action = source_unknown();
        size = SOURCE_TABLE_SIZE;
    }

    action drop_no_route() {
        drop(DROP_NO_ROUTE);
    }

    table route_ipv4 {
        key = {
            hdr.ipv4.dst_addr : lpm @name("dst_addr");
        }
        actions = {
            forward;
            drop_no_route;
        }
        default_action = drop_no_route();
        size = ROUTE_TABLE_SIZE;
    }

    action set_job_slot(job_slot_t slot) {
        meta.job_slot = slot;
    }

    action job_unknown() {
        meta.job_slot = UNKNOWN_JOB_SLOT;
    }

    table lookup_job {
        key = {
            hdr.checkmate.job_id : exact @name("job_id");
        }
        actions = {
            set_job_slot;
            job_unknown;
        }
        default_action = job_unknown();
        size = JOB_TABLE_SIZE;
    }

    action set_multicast_group(multicast_group_t group) {
        CHECKMATE_SET_MULTICAST_GROUP(group);
        meta.replicated = 1;
    }

    action reject_replication() {
        CHECKMATE_REJECT_REPLICATION();
    }

    table replicate_to_shadow {
        key = {
            hdr.checkmate.job_id    : exact @name("job_id");
            CHECKMATE_INGRESS_PORT  : exact @name("ingress_port");
            hdr.checkmate.shard_key : exact @name("shard_key");
            meta.next_hop_port      : exact @name("next_hop_port");
        }
        actions = {
            set_multicast_group;
            reject_replication;
        }
        default_action = reject_replication();
        size = REPLICATION_TABLE_SIZE;
    }

#endif
