/*
 * Checkmate ingress, the steps v1model and TNA share: check the source, route,
 * then decide whether to copy to a shadow. Statements, included inside each
 * architecture's CheckmateIngress apply block, in the branch a packet reaches
 * once it passed that architecture's own header checks (parser errors,
 * IPv4, TTL; v1model also the IPv4 checksum). Uses the tables of
 * p4src/shared/ingress.p4 and, from the including file:
 *
 *   drop(reason), CHECKMATE_INGRESS_PORT       (see p4src/shared/ingress.p4)
 *   CHECKMATE_MEASURE_PAYLOAD()                set meta.payload_bytes (UDP length
 *                                              minus both headers) and
 *                                              meta.expected_bytes (element_count
 *                                              times the dtype's size, or a value
 *                                              no payload length can have)
 *   CHECKMATE_SET_UNICAST_PORT(port)           commit the unicast egress port
 *
 * The unicast port is committed only when no group was chosen (Tofino would
 * send both), and nothing drops after a group is chosen (v1model's
 * mark_to_drop would clear mcast_grp; tests/test_p4_program.py checks it).
 */

/* Only Checkmate packets (DATA, ACK, NACK, repairs) are checked. */
if (hdr.checkmate.isValid()) {
    check_source.apply();
}
if (meta.source_known == 1 && meta.source_port != CHECKMATE_INGRESS_PORT) {
    drop(DROP_SPOOFED_SOURCE);
} else {
    route_ipv4.apply();
    if (meta.routed == 1 && hdr.checkmate.isValid()
            && (hdr.checkmate.flags & CHECKMATE_FLAG_REPLICATE) != 0) {
        lookup_job.apply();
        /* The payload must be exactly element_count elements of dtype. */
        CHECKMATE_MEASURE_PAYLOAD();
        if (hdr.checkmate.msg_type != CHECKMATE_MSG_DATA
                || meta.payload_bytes != meta.expected_bytes) {
            meta.routed = 0;
            drop(DROP_MALFORMED_CHECKMATE);
        } else {
            replicate_to_shadow.apply();
        }
    }
    if (meta.routed == 1 && meta.replicated == 0) {
        CHECKMATE_SET_UNICAST_PORT(meta.next_hop_port);
    }
}
