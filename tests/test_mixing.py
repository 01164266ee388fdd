"""SNR mixing: levels, tiling, true power ratio, clipping guard, seeded Gaussian noise."""
import numpy as np
import pytest

from fake_corpora import estimate_snr_db, fake_noise, fake_speech
from tta_brain.data import mixing
from tta_brain.data.mixing import (gaussian_noise, mix_at_snr, normalize_to_dbfs, power_snr_db,
                                   rms_dbfs, tile_or_cut, utterance_seed)


def test_rms_dbfs_reference_values():
    t = np.arange(16000) / 16000
    assert rms_dbfs(np.sin(2 * np.pi * 100 * t)) == pytest.approx(-3.0103, abs=1e-3)
    assert rms_dbfs(np.full(100, 0.1)) == pytest.approx(-20.0, abs=1e-9)
    assert rms_dbfs(np.zeros(10)) == float("-inf")


@pytest.mark.parametrize("target", [-25.0, -10.0, -40.0])
def test_normalize_to_dbfs_hits_target(target):
    x = fake_speech(0.5, seed=3)
    y = normalize_to_dbfs(x, target)
    assert y.dtype == np.float32
    assert rms_dbfs(y) == pytest.approx(target, abs=1e-4)
    # a pure gain: the shape is unchanged
    np.testing.assert_allclose(y / y[np.argmax(np.abs(y))], x / x[np.argmax(np.abs(x))], atol=1e-5)


def test_normalize_silence_raises():
    with pytest.raises(ValueError, match="silent"):
        normalize_to_dbfs(np.zeros(100))


def test_tile_or_cut_tiles_from_offset_zero():
    noise = np.arange(7, dtype=np.float32)
    out = tile_or_cut(noise, 23)
    assert out.shape == (23,)
    np.testing.assert_array_equal(out, np.arange(23) % 7)
    np.testing.assert_array_equal(tile_or_cut(noise, 4), [0, 1, 2, 3])  # cut, from the start
    np.testing.assert_array_equal(tile_or_cut(noise, 7), noise)
    with pytest.raises(ValueError, match="empty"):
        tile_or_cut(np.array([]), 5)


@pytest.mark.parametrize("snr", [-5.0, 0.0, 5.0, 10.0, 20.0])
def test_mix_at_snr_true_power_ratio(snr):
    speech, noise = fake_speech(1.0, seed=1), fake_noise(0.3, seed=2, kind=1)
    mixture, s, n = mix_at_snr(speech, noise, snr, return_parts=True)
    assert mixture.shape == speech.shape
    np.testing.assert_allclose(mixture, s + n, atol=1e-6)
    assert power_snr_db(s, n) == pytest.approx(snr, abs=1e-3)
    # both were set to -25 dBFS first; the noise gain is then 10^(-snr/20) (no sqrt: not halved)
    assert rms_dbfs(s) == pytest.approx(-25.0, abs=1e-3)
    assert rms_dbfs(n) == pytest.approx(-25.0 - snr, abs=1e-3)
    # the noise component is the tiled noise (period = noise length), up to a gain
    period = noise.size
    np.testing.assert_allclose(n[period:2 * period], n[:period], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(n[:period] / n[:period].std(), noise / noise.std(), atol=1e-3)


def test_mix_at_snr_does_not_halve_snr_like_ms_snsd():
    speech, noise = fake_speech(1.0, seed=4), fake_noise(1.0, seed=5)
    _, s, n = mix_at_snr(speech, noise, 10.0, return_parts=True)
    assert power_snr_db(s, n) == pytest.approx(10.0, abs=1e-3)
    assert abs(power_snr_db(s, n) - 5.0) > 4  # MS-SNSD's sqrt bug would give 5 dB


def test_mix_at_snr_takes_its_target_level_and_refuses_several_channels():
    speech, noise = fake_speech(1.0, seed=4), fake_noise(1.0, seed=5)
    _, s, n = mix_at_snr(speech, noise, 10.0, target_dbfs=-30.0, return_parts=True)
    assert rms_dbfs(s) == pytest.approx(-30.0, abs=1e-3)
    assert rms_dbfs(n) == pytest.approx(-40.0, abs=1e-3)
    with pytest.raises(ValueError, match=r"expected a 1-D signal, got shape \(2, 16000\)"):
        mix_at_snr(np.stack([speech, speech]), noise, 10.0)          # stereo: not averaged here


@pytest.mark.parametrize("sign", [1.0, -1.0])  # negative peaks clip as much as positive ones
def test_clipping_guard_scales_both_and_keeps_snr(sign):
    # a very peaky "speech" signal: at -25 dBFS RMS its peaks exceed full scale
    speech = np.zeros(16000, dtype=np.float32)
    speech[::4000] = sign
    mixture, s, n = mix_at_snr(speech, fake_noise(0.5, seed=6), 0.0, return_parts=True)
    assert np.abs(mixture).max() == pytest.approx(mixing.CLIP_HEADROOM, abs=1e-6)
    assert power_snr_db(s, n) == pytest.approx(0.0, abs=1e-3)
    assert rms_dbfs(s) < -25.0  # level lowered to avoid clipping


def test_gaussian_noise_seeded():
    a, b, c = gaussian_noise(20000, 1), gaussian_noise(20000, 1), gaussian_noise(20000, 2)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert a.dtype == np.float32
    assert a.std() == pytest.approx(1.0, abs=0.03) and abs(a.mean()) < 0.03
    # per-utterance seeds: stable across processes (pinned: a process-salted hash() of the key
    # gave each rerun of data preparation other noise), distinct per key
    assert utterance_seed(666, "x") == [666, 2363233923]               # CRC-32 of b"x"
    assert utterance_seed(7, "u1") == [7, 1112514422]
    assert utterance_seed(666, "x") != utterance_seed(666, "y")
    np.testing.assert_array_equal(gaussian_noise(10, utterance_seed(666, "u1")),
                                  gaussian_noise(10, utterance_seed(666, "u1")))


def test_estimator_measures_mixture():
    speech, noise = fake_speech(0.7, seed=7), fake_noise(0.2, seed=8, kind=2)
    mixture = mix_at_snr(speech, noise, 7.5)
    assert estimate_snr_db(mixture, speech, tile_or_cut(noise, speech.size)) == \
        pytest.approx(7.5, abs=1e-3)


def test_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    speech = torch.from_numpy(fake_speech(0.5, seed=9))
    out = mix_at_snr(speech, torch.from_numpy(fake_noise(0.1, seed=1)), 5.0)
    assert isinstance(out, np.ndarray) and out.shape == (speech.numel(),)


def test_power_snr_of_silent_noise_is_infinite():
    s = np.sin(np.arange(1000) / 10.0)
    assert power_snr_db(s, np.zeros(1000)) == float("inf")
    assert power_snr_db(s, 0.1 * s) == pytest.approx(20.0)
