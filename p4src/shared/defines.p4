/*
 * Checkmate: constants and table sizes shared by the v1model and TNA programs.
 * Every size lives here and nowhere else; docs/protocol.md documents the
 * wire-format constants and checkmate/wire.py mirrors them (a test keeps the
 * three in step).
 */
#ifndef CHECKMATE_DEFINES_P4
#define CHECKMATE_DEFINES_P4

/* ---- wire format ---- */
const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8>  IP_PROTOCOL_UDP = 17;
const bit<16> CHECKMATE_UDP_PORT = 48879;
const bit<8>  CHECKMATE_VERSION = 1;
const bit<16> UDP_HEADER_BYTES = 8;
const bit<16> CHECKMATE_HEADER_BYTES = 32;

const bit<8>  CHECKMATE_MSG_DATA = 1;
const bit<8>  CHECKMATE_FLAG_REPLICATE = 0x01;

const bit<8>  CHECKMATE_DTYPE_FP32 = 1;
const bit<8>  CHECKMATE_DTYPE_BF16 = 2;
const bit<8>  CHECKMATE_DTYPE_FP16 = 3;

/* ---- table and counter sizes ---- */
#define ROUTE_TABLE_SIZE 1024
#define JOB_TABLE_SIZE 255
#define REPLICATION_TABLE_SIZE 4096
#define SHADOW_DESTINATION_TABLE_SIZE 1024
/* check_source holds one entry per route_ipv4 entry (a /32 per known host). */
#define SOURCE_TABLE_SIZE 1024
/* Job slot 0 counts packets of job ids the controller never registered. */
#define JOB_SLOT_COUNT 256
#define DROP_REASON_COUNT 8

typedef bit<8>  job_slot_t;
typedef bit<16> multicast_group_t;

const job_slot_t UNKNOWN_JOB_SLOT = 0;

/* ---- drop reasons: index into ingress_drops / egress_drops ---- */
const bit<8> DROP_NOT_IPV4 = 0;
const bit<8> DROP_NO_ROUTE = 1;
const bit<8> DROP_TTL_EXPIRED = 2;
const bit<8> DROP_MALFORMED_PACKET = 3;
const bit<8> DROP_MALFORMED_CHECKMATE = 4;
const bit<8> DROP_BAD_IPV4_CHECKSUM = 5;
const bit<8> DROP_NO_SHADOW_DESTINATION = 6;
/* A Checkmate packet from a known host's address that came in on another port. */
const bit<8> DROP_SPOOFED_SOURCE = 7;

#endif
