"""Registration modules of the first-party environments (one entry point each)."""
