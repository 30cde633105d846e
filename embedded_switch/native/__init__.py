"""The embedded switch's native data path (a C extension built by setup.py); work in progress."""
