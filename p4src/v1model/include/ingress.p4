/*
 * Checkmate v1model ingress: check the source, route, then decide whether to
 * copy to a shadow.
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
 * The unicast port is committed only when no group was chosen, and nothing
 * calls mark_to_drop after a group is set (it would clear mcast_grp).
 */
control CheckmateIngress(inout headers_t hdr,
                         inout checkmate_metadata_t meta,
                         inout standard_metadata_t standard_metadata) {

    counter(DROP_REASON_COUNT, CounterType.packets) ingress_drops;
    counter(JOB_SLOT_COUNT, CounterType.packets_and_bytes) rejected_replications;

    action drop(bit<8> reason) {
        ingress_drops.count((bit<32>) reason);
        mark_to_drop(standard_metadata);
    }

    action forward(bit<9> port, bit<48> src_mac, bit<48> dst_mac) {
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
    action expect_port(bit<9> port) {
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
        standard_metadata.mcast_grp = group;
        meta.replicated = 1;
    }

    action reject_replication() {
        rejected_replications.count((bit<32>) meta.job_slot);
    }

    table replicate_to_shadow {
        key = {
            hdr.checkmate.job_id          : exact @name("job_id");
            standard_metadata.ingress_port : exact @name("ingress_port");
            hdr.checkmate.shard_key       : exact @name("shard_key");
            meta.next_hop_port            : exact @name("next_hop_port");
        }
        actions = {
            set_multicast_group;
            reject_replication;
        }
        default_action = reject_replication();
        size = REPLICATION_TABLE_SIZE;
    }

    apply {
        meta.routed = 0;
        meta.replicated = 0;
        meta.job_slot = UNKNOWN_JOB_SLOT;
        meta.source_known = 0;
        if (standard_metadata.parser_error != error.NoError) {
            if (hdr.udp.isValid() && hdr.udp.dst_port == CHECKMATE_UDP_PORT) {
                drop(DROP_MALFORMED_CHECKMATE);
            } else {
                drop(DROP_MALFORMED_PACKET);
            }
        } else if (!hdr.ipv4.isValid()) {
            drop(DROP_NOT_IPV4);
        } else if (standard_metadata.checksum_error == 1) {
            drop(DROP_BAD_IPV4_CHECKSUM);
        } else if (hdr.ipv4.ttl <= 1) {
            drop(DROP_TTL_EXPIRED);
        } else {
            /* Only Checkmate packets (DATA, ACK, NACK, repairs) are checked. */
            if (hdr.checkmate.isValid()) {
                check_source.apply();
            }
            if (meta.source_known == 1 && meta.source_port != standard_metadata.ingress_port) {
                drop(DROP_SPOOFED_SOURCE);
            } else {
                route_ipv4.apply();
                if (meta.routed == 1 && hdr.checkmate.isValid()
                        && (hdr.checkmate.flags & CHECKMATE_FLAG_REPLICATE) != 0) {
                    lookup_job.apply();
                    /* The payload must be exactly element_count elements of dtype. */
                    bit<32> payload_bytes = (bit<32>) (hdr.udp.length - UDP_HEADER_BYTES - CHECKMATE_HEADER_BYTES);
                    bit<32> expected_bytes = 0xFFFFFFFF;
                    if (hdr.checkmate.element_count[31:16] == 0) {
                        if (hdr.checkmate.dtype == CHECKMATE_DTYPE_FP32) {
                            expected_bytes = hdr.checkmate.element_count << 2;
                        } else if (hdr.checkmate.dtype == CHECKMATE_DTYPE_BF16
                                   || hdr.checkmate.dtype == CHECKMATE_DTYPE_FP16) {
                            expected_bytes = hdr.checkmate.element_count << 1;
                        }
                    }
                    if (hdr.checkmate.msg_type != CHECKMATE_MSG_DATA || payload_bytes != expected_bytes) {
                        meta.routed = 0;
                        drop(DROP_MALFORMED_CHECKMATE);
                    } else {
                        replicate_to_shadow.apply();
                    }
                }
                if (meta.routed == 1 && meta.replicated == 0) {
                    standard_metadata.egress_spec = meta.next_hop_port;
                }
            }
        }
    }
}
