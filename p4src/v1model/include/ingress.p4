/*
 * Checkmate v1model ingress: check the source, route, then decide whether to
 * copy to a shadow. The tables, their actions and the steps that apply them
 * are shared with TNA (p4src/shared/ingress.p4, p4src/shared/ingress_apply.p4);
 * what stays here is v1model's own:
 *
 *   - drop() counts in ingress_drops and calls mark_to_drop, and
 *     reject_replication counts in rejected_replications, where they happen
 *     (Tofino may address a counter from one place per packet only);
 *   - the header checks before the shared steps: the parser error (the shared
 *     parser verify()s the Checkmate version and UDP length here) and the
 *     incoming IPv4 checksum, which v1model verifies in CheckmateVerifyChecksum;
 *   - the payload-length arithmetic, done inline (measure_payload below),
 *     where Tofino needs a const table.
 *
 * The unicast port is committed only when no group was chosen, and nothing
 * calls mark_to_drop after a group is set (it would clear mcast_grp).
 */

/* v1model.p4 declares PortId_t only for V1MODEL_VERSION >= 20200408; p4c's default is older. */
typedef bit<9> port_id_t;

#define CHECKMATE_INGRESS_PORT standard_metadata.ingress_port
#define CHECKMATE_SET_MULTICAST_GROUP(group) standard_metadata.mcast_grp = group
#define CHECKMATE_REJECT_REPLICATION() rejected_replications.count((bit<32>) meta.job_slot)
#define CHECKMATE_MEASURE_PAYLOAD() measure_payload(hdr.udp, hdr.checkmate, meta.payload_bytes, meta.expected_bytes)
#define CHECKMATE_SET_UNICAST_PORT(port) standard_metadata.egress_spec = port

/*
 * Both sides of the payload-length check: the UDP payload after the Checkmate
 * header, and element_count times the dtype's size, or 0xFFFFFFFF (never a
 * payload length) when element_count is 2^16 or more or the dtype unknown.
 */
void measure_payload(in udp_h udp, in checkmate_h checkmate,
                     out bit<32> payload_bytes, out bit<32> expected_bytes) {
    payload_bytes = (bit<32>) (udp.length - UDP_HEADER_BYTES - CHECKMATE_HEADER_BYTES);
    expected_bytes = 0xFFFFFFFF;
    if (checkmate.element_count[31:16] == 0) {
        if (checkmate.dtype == CHECKMATE_DTYPE_FP32) {
            expected_bytes = checkmate.element_count << 2;
        } else if (checkmate.dtype == CHECKMATE_DTYPE_BF16
                   || checkmate.dtype == CHECKMATE_DTYPE_FP16) {
            expected_bytes = checkmate.element_count << 1;
        }
    }
}

control CheckmateIngress(inout headers_t hdr,
                         inout checkmate_metadata_t meta,
                         inout standard_metadata_t standard_metadata) {

    counter(DROP_REASON_COUNT, CounterType.packets) ingress_drops;
    counter(JOB_SLOT_COUNT, CounterType.packets_and_bytes) rejected_replications;

    action drop(bit<8> reason) {
        ingress_drops.count((bit<32>) reason);
        mark_to_drop(standard_metadata);
    }

#include "../../shared/ingress.p4"

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
#include "../../shared/ingress_apply.p4"
        }
    }
}
