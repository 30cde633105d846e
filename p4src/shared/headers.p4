/*
 * Checkmate: packet headers and metadata shared by both architectures.
 * The Checkmate header is 32 bytes, big-endian, 4-byte aligned
 * (docs/protocol.md; checkmate/wire.py packs the same layout).
 */
#ifndef CHECKMATE_HEADERS_P4
#define CHECKMATE_HEADERS_P4

header ethernet_h {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

header ipv4_h {
    bit<4>  version;
    bit<4>  ihl;
    bit<6>  dscp;
    bit<2>  ecn;
    bit<16> total_len;
    bit<16> identification;
    bit<3>  flags;
    bit<13> frag_offset;
    bit<8>  ttl;
    bit<8>  protocol;
    bit<16> hdr_checksum;
    bit<32> src_addr;
    bit<32> dst_addr;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

header checkmate_h {
    bit<8>  version;
    bit<8>  msg_type;
    bit<8>  flags;
    bit<8>  dtype;
    bit<32> job_id;
    bit<32> iteration;
    bit<16> bucket_id;
    bit<16> sender_rank;
    bit<16> shard_key;
    bit<16> reserved;
    bit<32> element_offset;
    bit<32> element_count;
    bit<32> sequence;
}

/*
 * Ingress-to-egress metadata. TNA carries it in front of the packet
 * (bridged); on v1model it is never made valid and so never emitted.
 */
header bridged_metadata_h {
    bit<7>     pad;
    bit<1>     replicated;
    job_slot_t job_slot;
}

struct headers_t {
    bridged_metadata_h bridged;
    ethernet_h         ethernet;
    ipv4_h             ipv4;
    udp_h              udp;
    checkmate_h        checkmate;
}

struct checkmate_metadata_t {
    bit<9>     next_hop_port;   /* chosen by route_ipv4, committed after replication */
    bit<1>     routed;
    bit<1>     replicated;
    job_slot_t job_slot;
    bit<1>     checksum_error;
    bit<1>     source_known;    /* check_source matched: the source is a known host */
    bit<9>     source_port;     /* ... which must be on this ingress port */
    bit<32>    payload_bytes;   /* UDP length minus the UDP and Checkmate headers */
    bit<32>    expected_bytes;  /* element_count times the dtype's size; 0xFFFFFFFF if impossible */
}

#endif
