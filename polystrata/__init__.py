"""PolyStrata: GGUF models compiled to kernels generated at run time, for any accelerator."""

__version__ = "0.1.0"
