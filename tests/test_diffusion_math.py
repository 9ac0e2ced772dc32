"""The SDE step, its log-probability and KL, the losses, and the model adapters' conventions
(checked against diffusers' own pipelines)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from reasonctl.diffusion.adapters.base import TextCondition
from reasonctl.diffusion.losses import (
    FlowLossParts,
    FlowLossSettings,
    advantages,
    flow_matching_loss,
    flow_policy_loss,
)
from reasonctl.diffusion.sde import (
    Schedule,
    flow_schedule,
    gaussian_log_prob,
    mean_kl,
    ode_step,
    sde_mean,
    sde_step,
    transition_std,
)
from tests.diffusion_support import tiny_pipelines  # noqa: F401


def test_schedule_matches_diffusers_flow_match_euler() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    schedule = flow_schedule(10, shift=3.0)
    reference = FlowMatchEulerDiscreteScheduler(shift=3.0)
    reference.set_timesteps(10)
    assert torch.allclose(schedule.sigmas, reference.sigmas.float())
    assert schedule.sigmas[0] == 1.0 and schedule.sigmas[-1] == 0.0 and schedule.steps == 10
    std = schedule.std_dev(0.7)
    sigma = schedule.sigmas[:-1].double()
    expected = 0.7 * torch.sqrt(sigma / (1 - sigma))
    expected[0] = 0.7 * math.sqrt(sigma[1] / (1 - sigma[1]))  # sigma = 1 uses the next sigma
    assert torch.allclose(std.double(), expected, rtol=1e-6)


def test_log_prob_is_the_gaussian_density_averaged_over_dimensions() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 2, 5, 5)
    v = torch.randn_like(x)
    sigma = torch.tensor([0.9, 0.5, 0.2])
    sigma_next = torch.tensor([0.7, 0.3, 0.0])
    std_dev = torch.tensor([0.8, 0.6, 0.4])
    step = sde_step(v, x, sigma, sigma_next, std_dev, noise=torch.randn_like(x))
    mean = sde_mean(x, v, sigma, sigma_next, std_dev)
    s = transition_std(sigma, sigma_next, std_dev)
    for b in range(3):
        density = torch.distributions.Normal(mean[b].double(), s[b].double())
        expected = density.log_prob(step.next_latents[b].double()).mean()
        assert step.log_prob[b].item() == pytest.approx(expected.item(), rel=1e-5)
    assert step.log_prob.dtype == torch.float32
    # the mean is FlowGRPO's: x + [v + g^2/(2 s) (x + (1 - s) v)] dt
    g2 = (std_dev**2).view(-1, 1, 1, 1, 1)
    sg = sigma.view(-1, 1, 1, 1, 1)
    dt = (sigma_next - sigma).view(-1, 1, 1, 1, 1)
    assert torch.allclose(mean, x + (v + g2 / (2 * sg) * (x + (1 - sg) * v)) * dt, atol=1e-6)
    # scoring the sampled point again (bf16 velocity, as under autocast) gives the float32
    # log-prob of the same transition
    again = gaussian_log_prob(step.next_latents, mean, s)
    assert torch.equal(again, step.log_prob)


def test_masked_log_prob_and_kl_average_over_generated_elements_only() -> None:
    torch.manual_seed(1)
    mean = torch.randn(2, 3, 4, 2, 2)
    ref = mean + 0.1 * torch.randn_like(mean)
    sample = mean + torch.randn_like(mean)
    std = torch.tensor([0.5, 0.25])
    mask = torch.ones(2, 1, 4, 2, 2)
    mask[:, :, 0] = 0
    got = mean_kl(mean, ref, std, mask)
    for b in range(2):
        kept = ((mean[b] - ref[b])[:, 1:] ** 2 / (2 * std[b] ** 2)).mean()
        assert got[b].item() == pytest.approx(kept.item(), rel=1e-5)
        p = torch.distributions.Normal(mean[b][:, 1:].double(), std[b].double())
        q = torch.distributions.Normal(ref[b][:, 1:].double(), std[b].double())
        assert got[b].item() == pytest.approx(torch.distributions.kl_divergence(p, q).mean()
                                              .item(), rel=1e-5)
    logp = gaussian_log_prob(sample, mean, std, mask)
    expected = torch.distributions.Normal(mean[0][:, 1:], std[0]).log_prob(sample[0][:, 1:])
    assert logp[0].item() == pytest.approx(expected.mean().item(), rel=1e-5)


def test_sde_samples_have_the_transition_std_and_ode_is_euler() -> None:
    x = torch.zeros(1, 20000)
    v = torch.ones_like(x)
    sigma, sigma_next, std_dev = torch.tensor([0.6]), torch.tensor([0.4]), torch.tensor([0.5])
    generator = torch.Generator().manual_seed(0)
    step = sde_step(v, x, sigma, sigma_next, std_dev,
                    noise=torch.randn(x.shape, generator=generator))
    spread = (step.next_latents - step.mean).std().item()
    assert spread == pytest.approx(0.5 * math.sqrt(0.2), rel=0.02)
    assert torch.allclose(ode_step(v, x, sigma, sigma_next), torch.full_like(x, -0.2))


def test_advantages_are_group_normalised_transformed_and_clipped() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv = advantages(rewards, 3, clip=5.0)
    assert adv[:3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-5)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # equal rewards: no signal
    assert advantages(rewards, 3, clip=0.5)[:3].tolist() == pytest.approx([-0.5, 0.0, 0.5])
    exp = advantages(rewards, 3, clip=5.0, exp_reward=True)
    assert exp[:3].tolist() == pytest.approx([-math.e, -1.0, -math.exp(-1.0)], abs=1e-5)


def test_clipped_loss_kl_and_data_terms() -> None:
    log_prob = torch.tensor([0.0, 0.1, -0.1], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -1.0])
    settings = FlowLossSettings(clip_range=0.05)
    loss, metrics = flow_policy_loss(FlowLossParts(log_prob, old, adv), settings, count=6.0)
    loss.backward()
    # transition 2 and 3 are beyond the clip in the direction their advantage pushes
    assert log_prob.grad.tolist() == pytest.approx([-1.0 / 6, 0.0, 0.0])
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 3)
    assert float(metrics["ratio_dev_max"]) == pytest.approx(math.exp(0.1) - 1, rel=1e-5)
    mean = torch.zeros(3, 4)
    ref = torch.ones(3, 4)
    std = torch.full((3,), 0.5)
    data_loss = flow_matching_loss(torch.zeros(3, 4), torch.ones(3, 4), torch.zeros(3, 4))
    assert data_loss.tolist() == [1.0, 1.0, 1.0]
    loss, metrics = flow_policy_loss(
        FlowLossParts(torch.zeros(3), old, torch.zeros(3), mean, ref, std, None, data_loss),
        FlowLossSettings(kl_beta=0.5, data_beta=0.1), count=3.0)
    assert float(metrics["kl"]) == pytest.approx(2.0)  # 1 / (2 * 0.25)
    assert loss.item() == pytest.approx(0.5 * 2.0 + 0.1 * 1.0)


def test_text_conditions_pad_and_select() -> None:
    a = TextCondition(torch.ones(2, 3, 4), torch.ones(2, 5))
    b = TextCondition(torch.full((1, 5, 4), 2.0), torch.zeros(1, 5))
    both = TextCondition.cat([a, b])
    assert both.embeds.shape == (3, 5, 4) and both.embeds[0, 3:].abs().sum() == 0
    assert torch.equal(both.select([2, 0]).embeds[0], b.embeds[0])


@pytest.mark.parametrize("family", ["wan", "sd3"])
def test_deterministic_sampler_equals_the_diffusers_pipeline(
        family: str, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    """The adapter's conventions (timestep scale, text layout, latents) are the pipeline's:
    the same noise and prompt embeddings give the same latents as ``pipe(...)``."""
    from diffusers import DiffusionPipeline

    from reasonctl.diffusion.adapters import adapter_for
    from reasonctl.diffusion.sampler import SamplingPlan, draw, generators, sample

    model_dir = tiny_pipelines[family]
    pipe = DiffusionPipeline.from_pretrained(model_dir)
    adapter = adapter_for(model_dir)
    encoder = adapter.load_text_encoder(torch.device("cpu"), torch.float32, 8)
    prompts = ["a red cat", "blue"]
    text = encoder.encode(prompts)
    frames = 5 if adapter.video else 1
    gens = generators([1, 2], torch.device("cpu"))
    noise = draw(gens, adapter.latent_shape(frames, 32, 32), torch.device("cpu"))
    ours = sample(pipe.transformer, adapter, SamplingPlan(flow_schedule(3, adapter.shift())),
                  text=text, noise=noise, gens=gens).latents
    common = dict(height=32, width=32, num_inference_steps=3, guidance_scale=1.0,
                  latents=noise.clone(), output_type="latent")
    if family == "wan":
        theirs = pipe(prompt_embeds=text.embeds, num_frames=5, **common).frames
        embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=8)
    else:
        theirs = pipe(prompt_embeds=text.embeds, pooled_prompt_embeds=text.pooled,
                      **common).images
        embeds, _, pooled, _ = pipe.encode_prompt(prompts, prompts, prompts,
                                                  do_classifier_free_guidance=False,
                                                  max_sequence_length=8)
        assert torch.allclose(pooled, text.pooled, atol=1e-5)
    assert torch.allclose(embeds, text.embeds, atol=1e-5)
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_cosmos_conditioning_frames_stay_on_their_path(
        tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    from reasonctl.diffusion.adapters import adapter_for
    from reasonctl.diffusion.policy import load_transformer
    from reasonctl.diffusion.sampler import SamplingPlan, draw, generators, sample

    model_dir = tiny_pipelines["cosmos"]
    adapter = adapter_for(model_dir)
    model = load_transformer(model_dir, dtype=torch.float32, device="cpu")
    shape = adapter.latent_shape(9, 32, 32)
    assert shape == (4, 3, 4, 4) and adapter.text_dims() == (64, None)
    text = adapter.load_text_encoder(torch.device("cpu"), torch.float32, 8).encode(["x", "y"])
    gens = generators([3, 4], torch.device("cpu"))
    noise = draw(gens, shape, torch.device("cpu"))
    clean = torch.randn(2, *shape)
    frames = adapter.frame_condition(clean, 1, noise)
    plan = SamplingPlan(Schedule(flow_schedule(4, 5.0).sigmas), noise_level=0.7,
                        record=(0, 1, 2, 3))
    out = sample(model, adapter, plan, text=text, noise=noise, gens=gens, frames=frames)
    assert torch.allclose(out.latents[:, :, :1], clean[:, :, :1], atol=1e-6)
    assert not torch.allclose(out.latents[:, :, 1:], clean[:, :, 1:])
    assert torch.isfinite(out.log_probs).all()


def test_compiled_blocks_can_serve_sampling_passes(monkeypatch: pytest.MonkeyPatch,
                                                   tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    """Denoising steps have fixed shapes, so a diffusion backend compiles them too."""
    from reasonctl.backends import compile as compile_module
    from reasonctl.diffusion.policy import load_transformer

    calls: list[bool] = []
    options: list[dict] = []

    def fake_compile(fn, **kwargs):  # records whether a pass with or without gradients used it
        options.append(kwargs)

        def run(*args, **kwargs):
            calls.append(torch.is_grad_enabled())
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(compile_module.torch, "compile", fake_compile)
    model = load_transformer(tiny_pipelines["sd3"], dtype=torch.float32, device="cpu")
    assert compile_module.compile_blocks(model, without_grad=True) == 2
    args = (torch.randn(1, 4, 4, 4), torch.randn(1, 5, 64), torch.randn(1, 64),
            torch.tensor([500.0]))
    with torch.no_grad():
        model(*args)
    model(*args)[0].sum().backward()
    assert calls == [False, False, True, True]
    assert options == [{"dynamic": False}]  # one static graph per shape (sampling, training)


def test_vae_batch_auto_codes_everything_at_once_and_halves_when_memory_runs_out() -> None:
    from reasonctl.diffusion.adapters.base import ChunkedVaeCodec

    class Codec(ChunkedVaeCodec):
        fits = 2
        calls: list[int] = []

        def encode_chunk(self, frames: torch.Tensor) -> torch.Tensor:
            return frames.float()

        def decode_chunk(self, latents: torch.Tensor) -> torch.Tensor:
            self.calls.append(len(latents))
            if len(latents) > self.fits:
                raise torch.cuda.OutOfMemoryError("out of memory")
            return latents * 2

    latents = torch.arange(5.0).view(5, 1)
    auto = Codec(None, torch.device("cpu"), torch.float32, batch=0)
    assert auto.decode(latents).flatten().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert auto.calls == [5, 2, 2, 1] and auto.fitted == 2
    auto.calls.clear()
    auto.decode(latents)
    assert auto.calls == [2, 2, 1]  # the size that fit is kept
    fixed = Codec(None, torch.device("cpu"), torch.float32, batch=3)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fixed.decode(latents)  # an explicit size is the user's: no silent change
