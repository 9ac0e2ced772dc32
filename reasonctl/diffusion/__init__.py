"""RL of flow-matching image and video models: FlowGRPO and DDRL on diffusers transformers.

The pieces, one job per module:

- :mod:`.pipeline_dir` reads a diffusers pipeline directory (``model_index.json``) and
  loads its components; :mod:`.adapters` hide each transformer's conventions (timestep
  scale, text conditioning, condition masks, latent layout, VAE normalisation) behind one
  interface, keyed by the diffusers class name;
- :mod:`.policy` builds the trainable transformer for the ``single`` and ``fsdp``
  backends (``[model.lora]`` through peft, frozen patterns, gradient checkpointing) and
  :mod:`.export` writes it back as a pipeline directory or a LoRA adapter;
- :mod:`.sde` is the math of one denoising step (the SDE transition with its Gaussian
  log-probability, the deterministic step, the KL between two transitions),
  :mod:`.sampler` the denoising loop that records trajectories, :mod:`.rollout` a step's
  sampling and scoring through the backend, :mod:`.trajectories` and :mod:`.batches` the
  recorded transitions as training batches and the forward pass that re-scores them,
  :mod:`.losses` the FlowGRPO / DDRL objectives and advantages;
- :mod:`.conditioning` turns samples into text conditions (the pipeline's own encoder
  or precomputed embeddings) and conditioning frames, :mod:`.media` reads and writes
  videos and images, :mod:`.datasets` holds the ``video_text`` and ``mock_media`` formats;
- :mod:`.flow_grpo` and :mod:`.ddrl` are the algorithms, :mod:`.config` their options,
  :mod:`.evaluation` the in-loop evaluation, :mod:`.infer` ``reasonctl infer`` for
  pipeline directories, :mod:`.tiny` tiny random pipelines built offline.

Heavy packages (diffusers, peft, av) are imported inside the functions that need them
(``pip install 'reasonctl[diffusion]'``).
"""
