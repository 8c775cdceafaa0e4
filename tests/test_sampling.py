"""Sampler: each stage of the chain on small constructed distributions, plus determinism and speed."""

import warnings

import numpy as np
import pytest

from polystrata.errors import PolystrataError
from polystrata.sampling import Sampler, SamplerConfig

# Only the stage under test is on; everything else is neutral.
OFF = dict(top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)


def cfg(**kw) -> SamplerConfig:
    return SamplerConfig(**{**OFF, "temperature": 1.0, "seed": 1234, **kw})


def draws(sampler: Sampler, logits, n: int, history=()) -> np.ndarray:
    return np.array([sampler.sample(logits, history) for _ in range(n)])


def logits_from_probs(p) -> np.ndarray:
    return np.log(np.asarray(p, dtype=np.float64)).astype(np.float32)


def test_defaults_are_llama_cpp_like():
    c = SamplerConfig()
    assert (c.temperature, c.top_k, c.top_p, c.min_p) == (0.8, 40, 0.95, 0.05)
    assert (c.repeat_penalty, c.repeat_last_n, c.seed) == (1.0, 64, None)


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    s = Sampler(SamplerConfig(temperature=0.0))
    for _ in range(20):
        x = rng.standard_normal(1000).astype(np.float32)
        assert s.sample(x, []) == int(np.argmax(x))
    assert Sampler(SamplerConfig(temperature=-1.0)).sample(np.array([0.0, 3.0, 1.0]), []) == 1


def test_top_k_1_is_greedy():
    rng = np.random.default_rng(1)
    s = Sampler(cfg(top_k=1))
    for _ in range(20):
        x = rng.standard_normal(500).astype(np.float32)
        assert s.sample(x) == int(np.argmax(x))


def test_temperature_near_zero_is_greedy():
    rng = np.random.default_rng(2)
    s = Sampler(cfg(temperature=1e-6))
    for _ in range(20):
        x = rng.standard_normal(500).astype(np.float32)
        assert s.sample(x) == int(np.argmax(x))


def test_denormal_temperature_is_greedy_without_warnings():
    # 1e-310 is above zero, so it samples; dividing by it overflows, which must not reach the console.
    x = np.array([0.5, 3.0, -np.inf, 1.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert draws(Sampler(cfg(temperature=1e-310)), x, 20).tolist() == [1] * 20


def test_top_k_restricts_support():
    x = np.linspace(0.0, 1.0, 10, dtype=np.float32)  # nearly flat: without top-k every token would show up
    got = set(draws(Sampler(cfg(top_k=3)), x, 2000).tolist())
    assert got == {7, 8, 9}
    assert len(set(draws(Sampler(cfg()), x, 2000).tolist())) == 10


def test_top_p_keeps_smallest_set_reaching_mass():
    p = [0.5, 0.25, 0.15, 0.06, 0.04]
    x = logits_from_probs(p)
    # 0.5 + 0.25 = 0.75 < 0.8 <= 0.9: the first three are needed, the fourth is not.
    assert set(draws(Sampler(cfg(top_p=0.8)), x, 3000).tolist()) == {0, 1, 2}
    assert set(draws(Sampler(cfg(top_p=0.7)), x, 3000).tolist()) == {0, 1}
    assert set(draws(Sampler(cfg(top_p=0.4)), x, 500).tolist()) == {0}
    assert set(draws(Sampler(cfg(top_p=0.95)), x, 5000).tolist()) == {0, 1, 2, 3}


def test_top_p_on_large_vocab_without_top_k():
    # Exercises the incremental partial sort: the nucleus is bigger than the first guess of 256.
    n = 50_000
    x = np.zeros(n, dtype=np.float32)
    x[:1000] = 5.0  # each of these has p = e^5 / (1000 e^5 + 49000) = 0.075%, so ~931 make up 70%
    got = draws(Sampler(cfg(top_p=0.7)), x, 3000)
    assert got.max() < 1000 and 500 < len(np.unique(got)) <= 932


def test_min_p_drops_tokens_below_fraction_of_max():
    p = [0.4, 0.3, 0.15, 0.1, 0.05]
    x = logits_from_probs(p)
    # min_p = 0.3: threshold 0.12 keeps tokens 0..2.
    assert set(draws(Sampler(cfg(min_p=0.3)), x, 3000).tolist()) == {0, 1, 2}
    assert set(draws(Sampler(cfg(min_p=0.2)), x, 5000).tolist()) == {0, 1, 2, 3}


def test_top_p_and_min_p_together_keep_the_shorter_prefix():
    p = [0.4, 0.3, 0.15, 0.1, 0.05]
    x = logits_from_probs(p)
    assert set(draws(Sampler(cfg(top_p=0.6, min_p=0.2)), x, 3000).tolist()) == {0, 1}
    assert set(draws(Sampler(cfg(top_p=0.99, min_p=0.3)), x, 3000).tolist()) == {0, 1, 2}


def test_top_p_mass_is_over_top_k_survivors():
    # After top-k=2 the survivors have mass 0.4/0.7 and 0.3/0.7; top-p=0.55 needs only the first.
    x = logits_from_probs([0.4, 0.3, 0.15, 0.1, 0.05])
    assert set(draws(Sampler(cfg(top_k=2, top_p=0.55)), x, 1000).tolist()) == {0}


def test_repetition_penalty_changes_argmax():
    x = np.array([0.0, 2.0, 1.8, -1.0], dtype=np.float32)
    greedy = SamplerConfig(temperature=0.0, repeat_penalty=1.5, repeat_last_n=64)
    assert Sampler(SamplerConfig(temperature=0.0)).sample(x, [1, 1]) == 1
    assert Sampler(greedy).sample(x, [1, 1]) == 2  # 2.0 / 1.5 < 1.8
    # Only the last n tokens count.
    last1 = SamplerConfig(temperature=0.0, repeat_penalty=1.5, repeat_last_n=1)
    assert Sampler(last1).sample(x, [1, 3]) == 1
    # Negative logits are multiplied, pushing them further down.
    y = np.array([-1.0, -1.2], dtype=np.float32)
    assert Sampler(greedy).sample(y, [0]) == 1
    # The caller's array is not modified.
    assert x[1] == 2.0


def test_penalty_ignores_out_of_range_history():
    x = np.array([1.0, 2.0], dtype=np.float32)
    s = Sampler(SamplerConfig(temperature=0.0, repeat_penalty=2.0))
    assert s.sample(x, np.array([5, -3, 1])) == 0


def test_same_seed_same_sequence_different_seed_differs():
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(5000).astype(np.float32) for _ in range(50)]

    def run(seed):
        s = Sampler(SamplerConfig(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
        return [s.sample(x, []) for x in xs]

    assert run(7) == run(7)
    assert run(7) != run(8)
    s = Sampler(SamplerConfig(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    first = [s.sample(x, []) for x in xs]
    s.reset()
    assert [s.sample(x, []) for x in xs] == first


def test_temperature_sampling_matches_softmax():
    x = np.array([1.0, 0.5, 0.0, -0.5, 2.0], dtype=np.float32)
    t = 0.7
    n = 20_000
    expected = np.exp(x / t) / np.exp(x / t).sum()
    counts = np.bincount(draws(Sampler(cfg(temperature=t, seed=99)), x, n), minlength=5)
    chi2 = float((((counts - n * expected) ** 2) / (n * expected)).sum())
    # 4 degrees of freedom: P(chi2 > 25) ~ 5e-5, so this only fails on a real bias.
    assert chi2 < 25, (counts, n * expected)


def test_rejects_bad_input_and_config():
    with pytest.raises(PolystrataError):
        SamplerConfig(top_p=1.5)
    with pytest.raises(PolystrataError):
        SamplerConfig(top_k=-1)
    with pytest.raises(PolystrataError):
        SamplerConfig(repeat_penalty=0.0)
    with pytest.raises(PolystrataError):
        Sampler(cfg()).sample(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(PolystrataError, match="NaN"):
        Sampler(cfg()).sample(np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(PolystrataError, match="NaN"):
        Sampler(SamplerConfig(temperature=0)).sample(np.array([0.0, np.nan], dtype=np.float32))


def test_neg_inf_logits_never_drawn():
    x = np.array([0.0, -np.inf, 0.0, -np.inf], dtype=np.float32)
    assert set(draws(Sampler(cfg()), x, 500).tolist()) == {0, 2}


def test_large_vocab_samples_from_the_peak():
    """On a 262k vocabulary every chain (top-k on or off) draws from the few tokens that hold the mass."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(262_144) * 2).astype(np.float32)
    peak = rng.choice(len(x), 20, replace=False)
    x[peak] += 20.0  # a peaked distribution: the other 262k tokens hold < 1e-3 of the mass
    configs = (SamplerConfig(seed=0), SamplerConfig(top_k=0, seed=0), SamplerConfig(top_k=0, min_p=0, seed=0))
    for config in configs:
        s = Sampler(config)
        drawn = {s.sample(x, list(range(64))) for _ in range(50)}
        assert drawn <= set(peak.tolist()), config
        assert len(drawn) > 1, config
