/*
 * Checkmate v1model egress: finish the replicas the replication engine made.
 *
 * Every replica of a replicated packet leaves with REPLICATE cleared, so no
 * later switch copies it again (exactly one switch replicates on any path).
 * The shadow copy (egress_rid = shadow id, never 0) is re-addressed by
 * rewrite_shadow_copy and counted per job. Because flags and addresses change,
 * the UDP checksum is set to 0 (allowed for UDP over IPv4); the IPv4 checksum
 * is recomputed in CheckmateComputeChecksum.
 */
control CheckmateEgress(inout headers_t hdr,
                        inout checkmate_metadata_t meta,
                        inout standard_metadata_t standard_metadata) {

    counter(JOB_SLOT_COUNT, CounterType.packets_and_bytes) shadow_copies;
    counter(DROP_REASON_COUNT, CounterType.packets) egress_drops;

    action set_shadow_destination(bit<48> src_mac, bit<48> dst_mac, bit<32> dst_addr, bit<16> dst_port) {
        hdr.ethernet.src_addr = src_mac;
        hdr.ethernet.dst_addr = dst_mac;
        hdr.ipv4.dst_addr = dst_addr;
        hdr.udp.dst_port = dst_port;
        shadow_copies.count((bit<32>) meta.job_slot);
    }

    action drop_shadow_copy() {
        egress_drops.count((bit<32>) DROP_NO_SHADOW_DESTINATION);
        mark_to_drop(standard_metadata);
    }

    table rewrite_shadow_copy {
        key = {
            standard_metadata.egress_rid : exact @name("egress_rid");
        }
        actions = {
            set_shadow_destination;
            drop_shadow_copy;
        }
        default_action = drop_shadow_copy();
        size = SHADOW_DESTINATION_TABLE_SIZE;
    }

    apply {
        if (meta.replicated == 1 && hdr.checkmate.isValid()) {
            hdr.checkmate.flags = hdr.checkmate.flags & ~CHECKMATE_FLAG_REPLICATE;
            hdr.udp.checksum = 0;
            if (standard_metadata.egress_rid != 0) {
                rewrite_shadow_copy.apply();
            }
        }
    }
}
