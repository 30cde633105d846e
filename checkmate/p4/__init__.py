"""P4 facts shared by the controller, the embedded switch and the emulated network.

One place for what every side of P4Runtime must agree on:

- :mod:`checkmate.p4.program`: where the Checkmate program's P4Info and BMv2 JSON lie in
  the checkout, and the switch targets (:class:`~checkmate.p4.program.Target`);
- :mod:`checkmate.p4.p4info`: loading a P4Info, match kinds, and the index of its tables,
  actions, counters and packet metadata by id and by name;
- :mod:`checkmate.p4.bytestrings`: the P4Runtime bytestring codec;
- :mod:`checkmate.p4.tofino`: the Tofino-specific parts of a TNA P4Info (``Counter`` externs).
"""
