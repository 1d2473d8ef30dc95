"""qsa_adapters: thin maps from engines' paged metadata onto `qsa_core` (no QSA math here)."""
