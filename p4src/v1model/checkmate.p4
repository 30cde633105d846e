/*
 * Checkmate data plane for BMv2 (v1model).
 *
 * Forwards IPv4 as a router and copies tagged gradient packets (Checkmate
 * header with REPLICATE set, from a port enrolled in the job) to the job's
 * shadow node through the packet replication engine.
 *
 *   p4c --target bmv2 --arch v1model --p4runtime-files build/checkmate.p4info.txt \
 *       -o build p4src/v1model/checkmate.p4          (or: make p4)
 */
#include <core.p4>
#include <v1model.p4>

#include "../shared/defines.p4"
#include "../shared/headers.p4"
#include "../shared/parser.p4"

parser CheckmateParser(packet_in packet,
                       out headers_t hdr,
                       inout checkmate_metadata_t meta,
                       inout standard_metadata_t standard_metadata) {
    CheckmateHeaderParser() header_parser;

    state start {
        header_parser.apply(packet, hdr.ethernet, hdr.ipv4, hdr.udp, hdr.checkmate);
        transition accept;
    }
}

control CheckmateVerifyChecksum(inout headers_t hdr, inout checkmate_metadata_t meta) {
    /* A mismatch sets standard_metadata.checksum_error; ingress drops and counts it. */
    apply {
        verify_checksum(hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.dscp, hdr.ipv4.ecn,
              hdr.ipv4.total_len, hdr.ipv4.identification, hdr.ipv4.flags,
              hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
              hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum, HashAlgorithm.csum16);
    }
}

#include "include/ingress.p4"
#include "include/egress.p4"

control CheckmateComputeChecksum(inout headers_t hdr, inout checkmate_metadata_t meta) {
    apply {
        update_checksum(hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.dscp, hdr.ipv4.ecn,
              hdr.ipv4.total_len, hdr.ipv4.identification, hdr.ipv4.flags,
              hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
              hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum, HashAlgorithm.csum16);
    }
}

control CheckmateDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
        packet.emit(hdr.checkmate);
    }
}

V1Switch(CheckmateParser(),
         CheckmateVerifyChecksum(),
         CheckmateIngress(),
         CheckmateEgress(),
         CheckmateComputeChecksum(),
         CheckmateDeparser()) main;
