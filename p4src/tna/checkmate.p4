/*
 * Checkmate data plane for Tofino (TNA).
 *
 * Same behaviour, tables and names as p4src/v1model/checkmate.p4; only the
 * architecture shell differs (intrinsic metadata, bridged metadata, deparser
 * checksums). In the P4Info bf-p4c generates, names carry the pipe prefix
 * ("pipe.CheckmateIngress.route_ipv4"); the controller resolves tables by
 * their unqualified name, so it drives either program unchanged.
 * Unlike v1model, the incoming IPv4 header checksum is not verified here
 * (meta.checksum_error stays 0): Tofino MACs already drop frames with a bad FCS.
 *
 *   bf-p4c --arch tna --p4runtime-files build/tna/checkmate.p4info.txt \
 *          -o build/tna p4src/tna/checkmate.p4
 */
#include <core.p4>
#include <tna.p4>

#include "../shared/defines.p4"
#include "../shared/headers.p4"
#include "../shared/parser.p4"

parser CheckmateIngressParser(packet_in packet,
                              out headers_t hdr,
                              out checkmate_metadata_t meta,
                              out ingress_intrinsic_metadata_t ig_intr_md) {
    CheckmateHeaderParser() header_parser;

    state start {
        packet.extract(ig_intr_md);
        packet.advance(PORT_METADATA_SIZE);
        meta.next_hop_port = 0;
        meta.routed = 0;
        meta.replicated = 0;
        meta.job_slot = UNKNOWN_JOB_SLOT;
        meta.checksum_error = 0;
        transition parse_headers;
    }

    state parse_headers {
        header_parser.apply(packet, hdr);
        transition accept;
    }
}

#include "include/ingress.p4"

control CheckmateIngressDeparser(packet_out packet,
                                 inout headers_t hdr,
                                 in checkmate_metadata_t meta,
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
                             out checkmate_metadata_t meta,
                             out egress_intrinsic_metadata_t eg_intr_md) {
    CheckmateHeaderParser() header_parser;

    state start {
        packet.extract(eg_intr_md);
        packet.extract(hdr.bridged);
        meta.next_hop_port = 0;
        meta.routed = 0;
        meta.replicated = hdr.bridged.replicated;
        meta.job_slot = hdr.bridged.job_slot;
        meta.checksum_error = 0;
        transition parse_headers;
    }

    state parse_headers {
        header_parser.apply(packet, hdr);
        transition accept;
    }
}

#include "include/egress.p4"

control CheckmateEgressDeparser(packet_out packet,
                                inout headers_t hdr,
                                in checkmate_metadata_t meta,
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
