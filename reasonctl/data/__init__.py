"""Data handling shared by dataset formats and algorithms.

``messages`` turns raw rows into :class:`~reasonctl.core.types.Sample` objects (light, no
torch); ``processing`` turns samples into token ids, loss masks and batches; ``vision``
decodes images and videos into Qwen2.5-VL inputs. Import the submodules directly:
this package does not import torch on its own.
"""
