/*
 * Checkmate: the header parser both architectures instantiate.
 *
 * Ethernet -> IPv4 (no options, not a fragment) -> UDP -> Checkmate (on
 * CHECKMATE_UDP_PORT). Anything else stops early and is forwarded untouched.
 * A Checkmate header that is truncated, of another version, or whose UDP
 * length cannot hold it raises a parser error; ingress counts and drops it.
 * Tofino parsers cannot verify(): there the version and UDP length checks are
 * made first thing in ingress instead (p4src/tna/include/ingress.p4), with
 * the same drop reason.
 *
 * The four headers are out parameters: the caller's other headers (TNA's
 * bridged metadata) are never read here, so no header is used uninitialized.
 */
#ifndef CHECKMATE_PARSER_P4
#define CHECKMATE_PARSER_P4

error {
    CheckmateBadVersion,
    CheckmateBadLength
}

parser CheckmateHeaderParser(packet_in packet,
                             out ethernet_h ethernet,
                             out ipv4_h ipv4,
                             out udp_h udp,
                             out checkmate_h checkmate) {
    state start {
        packet.extract(ethernet);
        transition select(ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        packet.extract(ipv4);
        /* flags[0:0] is "more fragments": only whole, option-free datagrams carry our header. */
        transition select(ipv4.ihl, ipv4.flags[0:0], ipv4.frag_offset, ipv4.protocol) {
            (4w5, 1w0, 13w0, IP_PROTOCOL_UDP): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        packet.extract(udp);
        transition select(udp.dst_port) {
            CHECKMATE_UDP_PORT: parse_checkmate;
            default: accept;
        }
    }

    state parse_checkmate {
        packet.extract(checkmate);
#ifndef __TARGET_TOFINO__
        verify(checkmate.version == CHECKMATE_VERSION, error.CheckmateBadVersion);
        verify(udp.length >= UDP_HEADER_BYTES + CHECKMATE_HEADER_BYTES, error.CheckmateBadLength);
#endif
        transition accept;
    }
}

#endif
