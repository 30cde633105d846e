"""The Checkmate P4 program as package data: installed as :mod:`checkmate.p4.p4src` (setup.py).

Nothing here is Python: :mod:`checkmate.p4.program` finds the P4 sources and the committed
P4Info through :mod:`importlib.resources`, so that an installed package needs no checkout.
p4src/README.md says what v1model and TNA share (p4src/shared/, the ingress tables and steps
among it), what stays per architecture and why, and how names flow from the P4 source to
Python (the P4Info, then the generated :mod:`checkmate.p4.names`).
"""
