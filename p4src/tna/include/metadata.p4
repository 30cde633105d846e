/*
 * Checkmate TNA metadata: what each Tofino control carries between its tables.
 *
 * The v1model program keeps this in checkmate_metadata_t (p4src/shared).
 * Tofino needs a few more fields because it cannot do some things where
 * v1model does them:
 *   - a counter may be addressed from one place per packet only, so actions
 *     record a drop (dropped, drop_reason) or a refused copy (rejected) and
 *     one statement at the end of the control counts it;
 *   - a gateway (if) cannot do arithmetic, so the payload-length check
 *     computes both sides in a table's actions first (payload_bytes,
 *     expected_bytes) and the gateway compares the two fields.
 */
#ifndef CHECKMATE_TNA_METADATA_P4
#define CHECKMATE_TNA_METADATA_P4

struct ingress_metadata_t {
    PortId_t   next_hop_port;   /* chosen by route_ipv4, committed after replication */
    bit<1>     routed;
    bit<1>     replicated;
    job_slot_t job_slot;
    bit<1>     dropped;
    bit<8>     drop_reason;     /* index into ingress_drops when dropped == 1 */
    bit<1>     rejected;        /* replicate_to_shadow missed: count in rejected_replications */
    bit<16>    payload_bytes;   /* UDP length minus the UDP and Checkmate headers */
    bit<16>    expected_bytes;  /* element_count times the dtype's size; 0xFFFF if impossible */
    bit<1>     source_known;    /* check_source matched: the source is a known host */
    PortId_t   source_port;     /* ... which must be on this ingress port */
}

struct egress_metadata_t {
    bit<1>     replicated;      /* from the bridged header */
    job_slot_t job_slot;        /* from the bridged header */
    bit<1>     dropped;         /* rewrite_shadow_copy found no destination */
}

#endif
