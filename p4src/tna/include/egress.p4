/*
 * Checkmate TNA egress: the same rewrite as p4src/v1model/include/egress.p4.
 * The multicast node's RID (the P4Runtime replica instance) is egress_rid;
 * the primary copy has RID 0, the shadow copy its shadow id.
 *
 * Tofino requires every counter a table's actions use to be addressed the same
 * way in all of them, so only set_shadow_destination counts (shadow_copies);
 * drop_shadow_copy records the drop and the end of apply counts it once in
 * egress_drops.
 */
control CheckmateEgress(inout headers_t hdr,
                        inout egress_metadata_t meta,
                        in egress_intrinsic_metadata_t eg_intr_md,
                        in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                        inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                        inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {

    Counter<bit<64>, job_slot_t>(JOB_SLOT_COUNT, CounterType_t.PACKETS_AND_BYTES) shadow_copies;
    Counter<bit<64>, bit<8>>(DROP_REASON_COUNT, CounterType_t.PACKETS) egress_drops;

    action set_shadow_destination(bit<48> src_mac, bit<48> dst_mac, bit<32> dst_addr, bit<16> dst_port) {
        hdr.ethernet.src_addr = src_mac;
        hdr.ethernet.dst_addr = dst_mac;
        hdr.ipv4.dst_addr = dst_addr;
        hdr.udp.dst_port = dst_port;
        shadow_copies.count(meta.job_slot);
    }

    action drop_shadow_copy() {
        meta.dropped = 1;
        eg_dprsr_md.drop_ctl = 1;
    }

    table rewrite_shadow_copy {
        key = {
            eg_intr_md.egress_rid : exact @name("egress_rid");
        }
        actions = {
            set_shadow_destination;
            drop_shadow_copy;
        }
        default_action = drop_shadow_copy();
        size = SHADOW_DESTINATION_TABLE_SIZE;
    }

    apply {
        hdr.bridged.setInvalid();
        if (meta.replicated == 1 && hdr.checkmate.isValid()) {
            hdr.checkmate.flags = hdr.checkmate.flags & ~CHECKMATE_FLAG_REPLICATE;
            hdr.udp.checksum = 0;
            if (eg_intr_md.egress_rid != 0) {
                rewrite_shadow_copy.apply();
            }
        }
        if (meta.dropped == 1) {
            egress_drops.count(DROP_NO_SHADOW_DESTINATION);
        }
    }
}
