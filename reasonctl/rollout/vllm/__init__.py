"""The ``vllm`` rollout engine: generation with vLLM, colocated or through a server.

- :mod:`.config`: ``[rollout.vllm]`` and the vLLM engine arguments it implies (torch-free).
- :mod:`.factory`: builds the engine for a run (the plugin's factory).
- :mod:`.engine`: the colocated engine (``vllm.LLM`` in the training process).
- :mod:`.server`: the server engine, with :mod:`.launch` (starting a server) and
  :mod:`.http` (talking to one).
- :mod:`.params`: sampling settings in vLLM's terms, vLLM's outputs as completions.
- Weight updates: :mod:`.transfer` registers reasonctl's backends of vLLM's weight-update
  protocol (in-process, and gloo for worker processes), :mod:`.sender` is the trainer's
  side of the gloo transfer and :mod:`.gloo` its packing and process group.

Importing this package imports neither torch nor vLLM.
"""
