/*
 * Checkmate: the header parser both architectures instantiate.
 *
 * Ethernet -> IPv4 (no options, not a fragment) -> UDP -> Checkmate (on
 * CHECKMATE_UDP_PORT). Anything else stops early and is forwarded untouched.
 * A Checkmate header that is truncated, of another version, or whose UDP
 * length cannot hold it raises a parser error; ingress counts and drops it.
 */
#ifndef CHECKMATE_PARSER_P4
#define CHECKMATE_PARSER_P4

error {
    CheckmateBadVersion,
    CheckmateBadLength
}

parser CheckmateHeaderParser(packet_in packet, inout headers_t hdr) {
    state start {
        packet.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        /* flags[0:0] is "more fragments": only whole, option-free datagrams carry our header. */
        transition select(hdr.ipv4.ihl, hdr.ipv4.flags[0:0], hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (4w5, 1w0, 13w0, IP_PROTOCOL_UDP): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        packet.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            CHECKMATE_UDP_PORT: parse_checkmate;
            default: accept;
        }
    }

    state parse_checkmate {
        packet.extract(hdr.checkmate);
        verify(hdr.checkmate.version == CHECKMATE_VERSION, error.CheckmateBadVersion);
        verify(hdr.udp.length >= UDP_HEADER_BYTES + CHECKMATE_HEADER_BYTES, error.CheckmateBadLength);
        transition accept;
    }
}

#endif
