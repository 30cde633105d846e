"""The Checkmate P4 program as package data: installed as :mod:`checkmate.p4.p4src` (setup.py).

Nothing here is Python: :mod:`checkmate.p4.program` finds the P4 sources and the committed
P4Info through :mod:`importlib.resources`, so that an installed package needs no checkout.
"""
