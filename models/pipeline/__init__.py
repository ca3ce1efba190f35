"""The quantize_and_save pipeline shared by every model: read -> recipe -> quantize -> pack -> save."""
