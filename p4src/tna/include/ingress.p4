/*
 * Checkmate TNA ingress: the tables, their actions and the steps that apply
 * them are shared with v1model (p4src/shared/ingress.p4,
 * p4src/shared/ingress_apply.p4); what stays here is the shape the Tofino
 * compiler needs where v1model's does not place:
 *
 *   - Each counter is addressed from exactly one place. drop() and
 *     reject_replication() only record what happened (meta.dropped and
 *     meta.drop_reason, meta.rejected); the end of apply counts it once in
 *     ingress_drops / rejected_replications.
 *   - Conditions compare fields with constants or with each other, never
 *     arithmetic: the payload length and the length element_count implies are
 *     computed into metadata by a const table's actions first (measure_payload).
 *   - Tofino drops parser verify(), so the two checks the shared parser makes
 *     on v1model (Checkmate version, UDP length >= UDP + Checkmate headers) are
 *     made here right after the parser-error check, by a const table
 *     (verify_checkmate_header), and drop the packet the same way.
 *   - Those two tables are @hidden: not in the P4Info, never written by the
 *     controller.
 *   - The incoming IPv4 header checksum is not verified (DROP_BAD_IPV4_CHECKSUM
 *     is never counted on Tofino; docs/protocol.md).
 *
 * Tofino sends a packet both unicast and multicast when both are set, so the
 * unicast port is written only when replicate_to_shadow chose no group.
 * The replication decision and job slot reach egress as bridged metadata.
 */

typedef PortId_t port_id_t;

#define CHECKMATE_INGRESS_PORT ig_intr_md.ingress_port
#define CHECKMATE_SET_MULTICAST_GROUP(group) ig_tm_md.mcast_grp_a = group
#define CHECKMATE_REJECT_REPLICATION() meta.rejected = 1
#define CHECKMATE_MEASURE_PAYLOAD() measure_payload.apply()
#define CHECKMATE_SET_UNICAST_PORT(port) ig_tm_md.ucast_egress_port = port

control CheckmateIngress(inout headers_t hdr,
                         inout ingress_metadata_t meta,
                         in ingress_intrinsic_metadata_t ig_intr_md,
                         in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                         inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                         inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {

    Counter<bit<64>, bit<8>>(DROP_REASON_COUNT, CounterType_t.PACKETS) ingress_drops;
    Counter<bit<64>, job_slot_t>(JOB_SLOT_COUNT, CounterType_t.PACKETS_AND_BYTES) rejected_replications;

    action drop(bit<8> reason) {
        meta.dropped = 1;
        meta.drop_reason = reason;
        ig_dprsr_md.drop_ctl = 1;
    }

#include "../../shared/ingress.p4"

    /*
     * The two checks v1model's parser verify()s, as a table because a gateway
     * cannot compare a 16-bit length with a range: a Checkmate header must
     * have CHECKMATE_VERSION and a UDP length of at least 40 bytes (UDP +
     * Checkmate headers); otherwise the packet is dropped as malformed.
     */
    action checkmate_header_ok() {
    }

    action malformed_checkmate() {
        drop(DROP_MALFORMED_CHECKMATE);
    }

    @hidden table verify_checkmate_header {
        key = {
            hdr.checkmate.version : ternary @name("version");
            hdr.udp.length        : ternary @name("udp_length");
        }
        actions = {
            checkmate_header_ok;
            malformed_checkmate;
        }
        const default_action = malformed_checkmate();  /* another version */
        const entries = {
            (CHECKMATE_VERSION, 0 &&& 0xFFE0)  : malformed_checkmate();  /* length 0..31 */
            (CHECKMATE_VERSION, 32 &&& 0xFFF8) : malformed_checkmate();  /* length 32..39 */
            (CHECKMATE_VERSION, _)             : checkmate_header_ok();
        }
        size = 4;
    }

    /*
     * Both sides of the payload-length check: payload_bytes = UDP length - 40,
     * expected_bytes = element_count times the dtype's size, or 0xFFFF (never a
     * payload length, as the UDP length is >= 40 here) when element_count is
     * too large or the dtype unknown. Done in a table's actions so that the
     * compiler cannot fold the arithmetic back into the comparison.
     */
    action expect_fp32() {
        meta.payload_bytes = hdr.udp.length - (UDP_HEADER_BYTES + CHECKMATE_HEADER_BYTES);
        meta.expected_bytes = hdr.checkmate.element_count[13:0] ++ 2w0;
    }

    action expect_16bit() {
        meta.payload_bytes = hdr.udp.length - (UDP_HEADER_BYTES + CHECKMATE_HEADER_BYTES);
        meta.expected_bytes = hdr.checkmate.element_count[14:0] ++ 1w0;
    }

    action expect_nothing() {
        meta.payload_bytes = hdr.udp.length - (UDP_HEADER_BYTES + CHECKMATE_HEADER_BYTES);
        meta.expected_bytes = 0xFFFF;
    }

    @hidden table measure_payload {
        key = {
            hdr.checkmate.dtype                : exact @name("dtype");
            hdr.checkmate.element_count[31:14] : ternary @name("element_count_high");
        }
        actions = {
            expect_fp32;
            expect_16bit;
            expect_nothing;
        }
        const default_action = expect_nothing();
        const entries = {
            (CHECKMATE_DTYPE_FP32, 0 &&& 0x3FFFF) : expect_fp32();   /* element_count < 2^14 */
            (CHECKMATE_DTYPE_BF16, 0 &&& 0x3FFFE) : expect_16bit();  /* element_count < 2^15 */
            (CHECKMATE_DTYPE_FP16, 0 &&& 0x3FFFE) : expect_16bit();
        }
        size = 4;
    }

    apply {
        if (ig_prsr_md.parser_err != 0) {
            if (hdr.udp.isValid() && hdr.udp.dst_port == CHECKMATE_UDP_PORT) {
                drop(DROP_MALFORMED_CHECKMATE);
            } else {
                drop(DROP_MALFORMED_PACKET);
            }
        } else if (hdr.checkmate.isValid()) {
            verify_checkmate_header.apply();
        }
        if (meta.dropped == 1) {
            /* counted below */
        } else if (!hdr.ipv4.isValid()) {
            drop(DROP_NOT_IPV4);
        } else if (hdr.ipv4.ttl <= 1) {
            drop(DROP_TTL_EXPIRED);
        } else {
#include "../../shared/ingress_apply.p4"
        }
        if (meta.dropped == 1) {
            ingress_drops.count(meta.drop_reason);
        }
        if (meta.rejected == 1) {
            rejected_replications.count(meta.job_slot);
        }
        hdr.bridged.setValid();
        hdr.bridged.pad = 0;
        hdr.bridged.replicated = meta.replicated;
        hdr.bridged.job_slot = meta.job_slot;
    }
}
