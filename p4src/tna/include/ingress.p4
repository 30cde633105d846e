/*
 * Checkmate TNA ingress: the same tables, keys and actions as the v1model
 * program (p4src/v1model/include/ingress.p4), on Tofino's intrinsic metadata.
 *
 * Tofino sends a packet both unicast and multicast when both are set, so the
 * unicast port is written only when replicate_to_shadow chose no group.
 * The replication decision and job slot reach egress as bridged metadata.
 */
control CheckmateIngress(inout headers_t hdr,
                         inout checkmate_metadata_t meta,
                         in ingress_intrinsic_metadata_t ig_intr_md,
                         in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                         inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                         inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {

    Counter<bit<64>, bit<8>>(DROP_REASON_COUNT, CounterType_t.PACKETS) ingress_drops;
    Counter<bit<64>, job_slot_t>(JOB_SLOT_COUNT, CounterType_t.PACKETS_AND_BYTES) rejected_replications;

    action drop(bit<8> reason) {
        ingress_drops.count(reason);
        ig_dprsr_md.drop_ctl = 1;
    }

    action forward(PortId_t port, bit<48> src_mac, bit<48> dst_mac) {
        meta.next_hop_port = port;
        meta.routed = 1;
        hdr.ethernet.src_addr = src_mac;
        hdr.ethernet.dst_addr = dst_mac;
        hdr.ipv4.ttl = hdr.ipv4.ttl - 1;
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
        ig_tm_md.mcast_grp_a = group;
        meta.replicated = 1;
    }

    action reject_replication() {
        rejected_replications.count(meta.job_slot);
    }

    table replicate_to_shadow {
        key = {
            hdr.checkmate.job_id    : exact @name("job_id");
            ig_intr_md.ingress_port : exact @name("ingress_port");
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

    apply {
        if (ig_prsr_md.parser_err != 0) {
            if (hdr.udp.isValid() && hdr.udp.dst_port == CHECKMATE_UDP_PORT) {
                drop(DROP_MALFORMED_CHECKMATE);
            } else {
                drop(DROP_MALFORMED_PACKET);
            }
        } else if (!hdr.ipv4.isValid()) {
            drop(DROP_NOT_IPV4);
        } else if (meta.checksum_error == 1) {
            drop(DROP_BAD_IPV4_CHECKSUM);
        } else if (hdr.ipv4.ttl <= 1) {
            drop(DROP_TTL_EXPIRED);
        } else {
            route_ipv4.apply();
            if (meta.routed == 1 && hdr.checkmate.isValid()
                    && (hdr.checkmate.flags & CHECKMATE_FLAG_REPLICATE) != 0) {
                lookup_job.apply();
                bit<16> payload_bytes = hdr.udp.length - (UDP_HEADER_BYTES + CHECKMATE_HEADER_BYTES);
                bit<16> expected_bytes = 0xFFFF;
                if (hdr.checkmate.element_count[31:14] == 0) {
                    if (hdr.checkmate.dtype == CHECKMATE_DTYPE_FP32) {
                        expected_bytes = hdr.checkmate.element_count[13:0] ++ 2w0;
                    } else if (hdr.checkmate.dtype == CHECKMATE_DTYPE_BF16
                               || hdr.checkmate.dtype == CHECKMATE_DTYPE_FP16) {
                        expected_bytes = 1w0 ++ hdr.checkmate.element_count[13:0] ++ 1w0;
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
                ig_tm_md.ucast_egress_port = meta.next_hop_port;
            }
        }
        hdr.bridged.setValid();
        hdr.bridged.pad = 0;
        hdr.bridged.replicated = meta.replicated;
        hdr.bridged.job_slot = meta.job_slot;
    }
}
