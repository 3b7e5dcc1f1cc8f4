"""GRPO against hand-computed numbers."""
import math

import pytest
import torch

from lockstep.framework.algo.grpo import GRPOConfig, group_advantages, grpo_loss, k3_kl


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_advantages(rewards, groups, eps=0.0)
    # group 0: mean 1/3, unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, (1 / 3) / s]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    flat = group_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    assert torch.equal(flat, torch.zeros(2))  # no signal when a group agrees
    unnorm = group_advantages(rewards, groups, norm_by_std=False)
    assert torch.allclose(unnorm[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    with pytest.raises(ValueError, match="n_samples >= 2"):
        group_advantages(torch.tensor([1.0]), torch.tensor([0]))


def test_clipped_loss_by_hand():
    # two samples, two tokens each; the second token of sample 1 is padding
    old = torch.zeros(2, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(0.7), 5.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True], [True, False]])
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.3)
    loss, m = grpo_loss(logp, old, adv, mask, cfg)
    # token terms: -min(r*A, clip(r)*A)
    # s0t0: r=1.5, A=1 -> min(1.5, 1.3) = 1.3 -> -1.3 (clipped)
    # s0t1: r=0.5, A=1 -> min(0.5, 0.8) = 0.5 -> -0.5
    # s1t0: r=0.7, A=-2 -> min(-1.4, -1.6) = -1.6 -> 1.6 (clipped)
    assert loss.item() == pytest.approx((-1.3 - 0.5 + 1.6) / 3, abs=1e-6)
    assert float(m["clipfrac"]) == pytest.approx(2 / 3)
    seq = grpo_loss(logp, old, adv, mask, GRPOConfig(clip_low=0.2, clip_high=0.3, loss_agg="seq_mean_token_mean"))[0]
    assert seq.item() == pytest.approx(((-1.3 - 0.5) / 2 + 1.6) / 2, abs=1e-6)


def test_kl_term_by_hand():
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    # k3 = exp(ref - logp) - (ref - logp) - 1 = 0.5 - ln 0.5 - 1
    k3 = 0.5 - math.log(0.5) - 1
    assert k3_kl(logp, ref).item() == pytest.approx(k3, abs=1e-6)
    cfg = GRPOConfig(kl_coef=0.1)
    loss, m = grpo_loss(logp, logp.detach(), torch.tensor([0.0]), torch.tensor([[True]]), cfg, ref)
    assert loss.item() == pytest.approx(0.1 * k3, abs=1e-6)
    assert float(m["kl_loss"]) == pytest.approx(k3, abs=1e-6)


def test_loss_gradient_direction():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    loss, _ = grpo_loss(logp, logp.detach(), torch.tensor([1.0]), torch.tensor([[True]]), GRPOConfig())
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.0)  # positive advantage pushes the logprob up


def test_config_errors():
    with pytest.raises(ValueError, match="valid: token_mean, seq_mean_token_mean"):
        GRPOConfig(loss_agg="sum")


def test_truncated_importance_sampling_by_hand():
    # trainer old logprobs vs the engine's: ratios 2, 0.5 and 4 (capped at 3); padding ignored
    old = torch.tensor([[math.log(0.4), math.log(0.2)], [math.log(0.8), 0.0]])
    engine = torch.tensor([[math.log(0.2), math.log(0.4)], [math.log(0.2), 0.0]])
    logp = old.clone()  # on-policy w.r.t. the trainer: the PPO ratio is 1, the pg term is -A
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True], [True, False]])
    plain, stats = grpo_loss(logp, old, adv, mask, GRPOConfig(), rollout_logp=engine)
    assert plain.item() == pytest.approx((-1 - 1 + 2) / 3, abs=1e-6)  # off: reported, not applied
    assert float(stats["tis_ratio_mean"]) == pytest.approx((2 + 0.5 + 4) / 3, rel=1e-5)
    assert float(stats["tis_differ"]) == pytest.approx(1.0)
    tis, stats = grpo_loss(logp, old, adv, mask, GRPOConfig(tis_cap=3.0), rollout_logp=engine)
    assert tis.item() == pytest.approx((-1 * 2 - 1 * 0.5 + 2 * 3) / 3, abs=1e-5)
    assert float(stats["tis_capped"]) == pytest.approx(1 / 3)
    # the engine's logprobs equal the trainer's: the ratio is exactly 1 and the loss unchanged, bitwise
    same, stats = grpo_loss(logp, old, adv, mask, GRPOConfig(tis_cap=3.0), rollout_logp=old.clone())
    assert torch.equal(same, grpo_loss(logp, old, adv, mask, GRPOConfig())[0])
    assert float(stats["tis_differ"]) == 0.0
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOConfig(tis_cap=0.5)


def test_an_agreeing_step_that_trains_off_ratio_one_is_refused():
    from lockstep.framework.consistency.compare import (LockstepMismatchError, check_importance_ratio,
                                                        compare_logp)

    a = torch.tensor([[-1.0, -2.0]])
    mask = torch.tensor([[True, True]])
    agreed = compare_logp(a, a.clone(), mask, torch.zeros(1, 2, dtype=torch.long), 1)
    check_importance_ratio(agreed, {"tis_differ": 0.0}, 1)
    with pytest.raises(LockstepMismatchError, match="importance ratio other than 1"):
        check_importance_ratio(agreed, {"tis_differ": 0.5}, 1)
    differed = compare_logp(a, a + 1, mask, torch.zeros(1, 2, dtype=torch.long), 1)
    check_importance_ratio(differed, {"tis_differ": 1.0}, 1)  # a reported mismatch trains on (report mode)
