"""reasonctl-rloo: the RLOO algorithm as a reasonctl plugin (``--algo rloo``)."""
