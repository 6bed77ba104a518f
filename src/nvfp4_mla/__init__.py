from . import abi, reference, validation  # noqa: F401
