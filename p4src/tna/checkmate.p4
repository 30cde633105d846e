/*
 * Checkmate data plane for Tofino (TNA for Tofino 1, T2NA for Tofino 2).
 *
 * Same behaviour, tables and names as p4src/v1model/checkmate.p4; the
 * architecture shell differs (intrinsic metadata, bridged metadata, deparser
 * checksums) and so does the shape of a few checks and counters, because the
 * Tofino compiler cannot place the v1model shape (p4src/tna/include/*.p4 say
 * where; docs/protocol.md says what each target checks where). In the P4Info
 * the Tofino compiler generates, names carry the pipe prefix
 * ("pipe.CheckmateIngress.route_ipv4") and counters are Tofino externs; the
 * controller resolves unqualified names and reads those externs, so it drives
 * either program (p4src/tna/checkmate.tofino.p4info.txtpb is that P4Info,
 * committed).
 * Unlike v1model, the incoming IPv4 header checksum is not verified here.
 *
 *   make p4-tofino      (p4c-barefoot --target tofino --arch tna, then bfas;
 *                        docs/tofino.md has the command line and the resources)
 */
#include <core.p4>
#if __TARGET_TOFINO__ == 2
#include <t2na.p4>
#else
#include <tna.p4>
#endif

#include "../shared/defines.p4"
#include "../shared/headers.p4"
#include "../shared/parser.p4"
#include "include/metadata.p4"

parser CheckmateIngressParser(packet_in packet,
                              out headers_t hdr,
                              out ingress_metadata_t meta,
                              out ingress_intrinsic_metadata_t ig_intr_md) {
    CheckmateHeaderParser() header_parser;

    state start {
        packet.extract(ig_intr_md);
        packet.advance(PORT_METADATA_SIZE);
        meta.next_hop_port = 0;
        meta.routed = 0;
        meta.replicated = 0;
        meta.job_slot = UNKNOWN_JOB_SLOT;
        meta.dropped = 0;
        meta.drop_reason = 0;
        meta.rejected = 0;
        meta.payload_bytes = 0;
        meta.expected_bytes = 0;
        meta.source_known = 0;
        meta.source_port = 0;
        /* The bridged header is made valid at the end of ingress, never parsed here. */
        hdr.bridged.setInvalid();
        transition parse_headers;
    }

    state parse_headers {
        header_parser.apply(packet, hdr.ethernet, hdr.ipv4, hdr.udp, hdr.checkmate);
        transition accept;
    }
}

#include "include/ingress.p4"

control CheckmateIngressDeparser(packet_out packet,
                                 inout headers_t hdr,
                                 in ingress_metadata_t meta,
                                 in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        hdr.ipv4.hdr_checksum = ipv4_checksum.update({
            hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.dscp, hdr.ipv4.ecn,
            hdr.ipv4.total_len, hdr.ipv4.identification, hdr.ipv4.flags,
            hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
            hdr.ipv4.src_addr, hdr.ipv4.dst_addr });
        packet.emit(hdr);
    }
}

parser CheckmateEgressParser(packet_in packet,
                             out headers_t hdr,
                             out egress_metadata_t meta,
                             out egress_intrinsic_metadata_t eg_intr_md) {
    CheckmateHeaderParser() header_parser;

    state start {
        packet.extract(eg_intr_md);
        packet.extract(hdr.bridged);
        meta.replicated = hdr.bridged.replicated;
        meta.job_slot = hdr.bridged.job_slot;
        meta.dropped = 0;
        transition parse_headers;
    }

    state parse_headers {
        header_parser.apply(packet, hdr.ethernet, hdr.ipv4, hdr.udp, hdr.checkmate);
        transition accept;
    }
}

#include "include/egress.p4"

control CheckmateEgressDeparser(packet_out packet,
                                inout headers_t hdr,
                                in egress_metadata_t meta,
                                in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        hdr.ipv4.hdr_checksum = ipv4_checksum.update({
            hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.dscp, hdr.ipv4.ecn,
            hdr.ipv4.total_len, hdr.ipv4.identification, hdr.ipv4.flags,
            hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
            hdr.ipv4.src_addr, hdr.ipv4.dst_addr });
        packet.emit(hdr);
    }
}

Pipeline(CheckmateIngressParser(),
         CheckmateIngress(),
         CheckmateIngressDeparser(),
         CheckmateEgressParser(),
         CheckmateEgress(),
         CheckmateEgressDeparser()) pipe;

Switch(pipe) main;
