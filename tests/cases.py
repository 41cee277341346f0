"""Cases shared by the format and kernel tests."""

# (name, options) of every block format, with the sign convention used for m (signed) and v (unsigned).
BLOCK_FORMATS = [
    ("int8", {}),
    ("int8", {"signed": False}),
    ("int4", {}),
    ("int4", {"signed": False}),
    ("int8_linear", {}),
    ("int8_linear", {"signed": False}),
    ("int4_linear", {}),
    ("fp8_e4m3", {}),
    ("fp8_e5m2", {}),
    ("e2m2", {"signed": False}),
    ("e3m0", {"signed": False}),
    ("e4m3", {}),
    ("e2m1", {}),
    ("e5m10", {}),
]
FORMAT_IDS = [f"{name}-{'u' if options.get('signed') is False else 's'}" for name, options in BLOCK_FORMATS]
