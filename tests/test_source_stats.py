"""Source statistics: the file format with its provenance, the ``python -m tta_brain.stats``
command, the kinds table, the Fisher kind against a direct computation, one-line errors."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import soundfile as sf
import torch
import torch.nn.functional as F

from fake_corpora import write_stream
from tta_brain import stats
from tta_brain.data.audio import load_audio
from tta_brain.data.manifest import read_manifest
from tta_brain.lobes.hf_ctc import HFCTCLobe
from tta_brain.methods import source_stats as ss
from tta_brain.data.cache import file_identity, file_sha1, source_identity
from tta_brain.data.manifest import expand_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return write_stream(tmp_path_factory.mktemp("clean"), n=5, block=10)


def run_cli(*argv):
    return stats.main([str(a) for a in argv])


def test_a_kind_the_model_cannot_give_is_named_with_the_kinds_it_can(clean, tmp_path, capsys):
    """On a SEW model (no partial forward) ``--kinds fisher,hidden,tokens`` failed as a whole
    with the partial forward's message, naming no kind, so EATA's Fisher (which needs none)
    looked impossible too. Now the line names the kinds and says which ones can be computed,
    before any kind is computed, and those alone are."""
    from tta_brain.lobes.testing import TINY, save_random_ctc_model
    sew = save_random_ctc_model(str(tmp_path / "sew"), 1, arch="sew", **TINY)
    out = tmp_path / "s.pt"
    base = ["--source", sew, "--manifest", clean / "stream.csv", "--data_root", clean, "--out",
            out, "--max_utts", 2]
    assert run_cli(*base, "--kinds", "fisher,hidden,tokens") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ERROR: --kinds hidden,tokens: SEWForCTC: a partial forward needs ")
    assert err.endswith("; --kinds fisher alone can be computed for it") and "\n" not in err
    assert not out.exists()
    assert run_cli(*base, "--kinds", "fisher") == 0
    assert ss.load(out).kinds == ["fisher"]


def test_cli_writes_fisher_with_provenance(clean, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "s" / "fisher.pt"
    assert run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root",
                   clean, "--kinds", "fisher", "--out", out, "--max_utts", 3) == 0
    rec = ss.load(out)
    assert rec.kinds == ["fisher"] and rec.n_utts == 3
    assert capsys.readouterr().out.strip() == (
        f"{out}: fisher: {len(rec.stats['fisher'])} tensors from 3 utterances of "
        f"{clean / 'stream.csv'} (model {rec.model})")
    assert rec.manifest_sha1 == file_sha1(clean / "stream.csv")
    assert rec.model == source_identity(tiny_model_dir)
    lobe = HFCTCLobe(tiny_model_dir)
    assert rec.model_params_sha1 == ss.params_sha1(lobe.model)
    rec.check_model(lobe.model, out)
    # F = 1/N sum_n (dL_n/dtheta)^2, L_n the mean frame CE against the argmax labels
    names = [n for n in rec.stats["fisher"]]
    params = dict(lobe.model.named_parameters())
    assert names and all("layer_norm" in n for n in names)
    want = {n: torch.zeros_like(params[n]) for n in names}
    for row in read_manifest(clean / "stream.csv", replacements={"data_root": str(clean)})[:3]:
        logits = lobe.model(lobe.prepare(load_audio(row["wav"]))).logits[0]
        loss = F.cross_entropy(logits, logits.argmax(-1))
        for n, g in zip(names, torch.autograd.grad(loss, [params[n] for n in names])):
            want[n] += g ** 2 / 3
    for n in names:
        assert torch.allclose(rec.stats["fisher"][n], want[n], rtol=1e-4, atol=1e-12), n
    assert any(float(v.sum()) > 0 for v in rec.stats["fisher"].values())


def test_target_lang_computes_an_mms_languages_statistics(clean, tmp_path, capsys):
    """An MMS checkpoint's statistics of another language than its own (EATA's Fisher, FOA's and
    E-BATS' hidden states) could not be made: ``--target_lang`` was no option (a kind's
    ``--key=value``, refused), and the statistics of the checkpoint's own language are refused by
    a run of another one. The file records the language; ``--reuse`` recomputes for another."""
    from tta_brain.lobes.testing import save_random_mms_model
    mms = save_random_mms_model(str(tmp_path / "mms"))
    out = tmp_path / "fra.pt"
    argv = ["--source", mms, "--manifest", clean / "stream.csv", "--data_root", clean,
            "--out", out, "--max_utts", 2, "--reuse"]
    assert run_cli(*argv, "--target_lang", "fra") == 0
    rec = ss.load(out)
    assert rec.target_lang == "fra"
    rec.check_model(HFCTCLobe(mms, target_lang="fra").model, out)
    assert any(".adapter_layer.norm." in n for n in rec.stats["fisher"])
    with pytest.raises(ss.SourceStatsError, match=r"computed on another model"):
        rec.check_model(HFCTCLobe(mms).model, out)
    capsys.readouterr()
    assert run_cli(*argv) == 0 and "another language (--target_lang), computing" in \
        capsys.readouterr().out
    rec = ss.load(out)
    assert rec.target_lang == "" and rec.model_params_sha1 == ss.params_sha1(HFCTCLobe(mms).model)
    with pytest.raises(ss.SourceStatsError, match=r"make them again with python -m tta_brain.stats"
                                                  r" .* --target_lang fra$"):
        rec.check_model(HFCTCLobe(mms, target_lang="fra").model, out)


def test_params_option_selects_the_tensors(clean, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "cnn.pt"
    assert run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root",
                   clean, "--out", out, "--max_utts", 0, "--params=cnn") == 0
    rec = ss.load(out)
    assert rec.n_utts == 5 and " tensors from 5 utterances of " in capsys.readouterr().out  # 0: all
    assert rec.options == {"params": "cnn"}
    assert all("feature_" in n for n in rec.stats["fisher"])


def test_a_new_kind_is_one_registration(clean, tiny_model_dir, tmp_path):
    @ss.register_kind("test_frames")
    def frames(lobe, inputs, options):
        return {"frames": torch.tensor([float(lobe.logits(x).shape[1]) for x in inputs])}
    try:
        rec = ss.compute(tiny_model_dir, clean / "stream.csv", ["test_frames", "fisher"],
                         data_root=str(clean), max_utts=2)
        assert rec.kinds == ["fisher", "test_frames"]
        assert rec.kind("test_frames")["frames"].shape == (2,)
        with pytest.raises(ValueError, match="taken"):
            ss.register_kind("test_frames")(lambda lobe, inputs, options: {})
    finally:
        ss.KINDS.pop("test_frames")


def test_errors_are_one_line_naming_the_file(tmp_path, clean, tiny_model_dir, capsys):
    missing = tmp_path / "none.pt"
    with pytest.raises(ss.SourceStatsError) as e:
        ss.load(missing)
    assert str(missing) in str(e.value) and "python -m tta_brain.stats" in str(e.value)
    junk = tmp_path / "junk.pt"
    junk.write_text("not a pickle")
    with pytest.raises(ss.SourceStatsError, match=f"{junk}: not a source statistics file"):
        ss.load(junk)
    torch.save({"format": "other"}, tmp_path / "other.pt")
    with pytest.raises(ss.SourceStatsError, match="not a source statistics file"):
        ss.load(tmp_path / "other.pt")
    rec = ss.SourceStats(stats={"fisher": {}}, manifest="m", manifest_sha1="x", model="m",
                         model_params_sha1="y", n_utts=1)
    ss.save(rec, tmp_path / "ok.pt")
    with pytest.raises(ss.SourceStatsError, match="no 'hidden' statistics .*--kinds hidden"):
        ss.load(tmp_path / "ok.pt").kind("hidden", tmp_path / "ok.pt")
    newer = torch.load(tmp_path / "ok.pt", weights_only=True) | {"version": ss.VERSION + 1}
    torch.save(newer, tmp_path / "newer.pt")          # a later format: not read as this one
    with pytest.raises(ss.SourceStatsError, match=f"^{tmp_path / 'newer.pt'}: statistics format "
                                                  f"version {ss.VERSION + 1}, this tta_brain "
                                                  f"reads {ss.VERSION}; make it again with "):
        ss.load(tmp_path / "newer.pt")
    assert run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root",
                   clean, "--kinds", "nope", "--out", tmp_path / "x.pt") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ERROR: unknown statistics kind(s) nope") and "\n" not in err
    assert run_cli("--source", tiny_model_dir, "--manifest", tmp_path / "no.csv",
                   "--out", tmp_path / "x.pt") == 1
    assert "no.csv" in capsys.readouterr().err
    assert run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root",
                   clean, "--kinds", "fisher", "--out", tmp_path / "x.pt", "--device", "gpu") == 1
    assert capsys.readouterr().err.strip() == ("ERROR: device = 'gpu' (--device) is not valid: "
                                               "use cpu, cuda or cuda:N")       # as decode says it
    # a mistyped kind option was ignored: --parms=cnn gave the default (layernorm) Fisher terms
    assert run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root",
                   clean, "--kinds", "fisher", "--out", tmp_path / "x.pt", "--parms=cnn") == 1
    assert capsys.readouterr().err.strip() == ("ERROR: --parms: not an option of the kind(s) "
                                               "fisher (--kinds); they take --params=...")
    assert run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root",
                   clean, "--kinds", "hidden", "--out", tmp_path / "x.pt", "--params=cnn") == 1
    assert "--params: not an option of the kind(s) hidden (--kinds); they take no options" in \
        capsys.readouterr().err
    assert run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root",
                   clean, "--out", tmp_path / "x.pt", "--max_utts", "-3") == 1   # was: all but 3
    assert capsys.readouterr().err.strip() == ("ERROR: --max_utts -3: must be >= 0 "
                                               "(0: all utterances)")
    assert run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root",
                   clean, "--out", tmp_path / "x.pt", "--max_utts", "-1") == 1   # not all but one
    assert "--max_utts -1: must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv",
                "--out", tmp_path / "x.pt", "--max_duration", "0")
    assert "--max_duration 0.0: must be > 0 seconds" in capsys.readouterr().err
    # a missing wav: the file alone was named; the manifest and the row are
    rows = (clean / "stream.csv").read_text().splitlines()
    broken = tmp_path / "broken.csv"
    broken.write_text("\n".join(rows[:2] + [rows[2].replace(".wav", "_gone.wav")]) + "\n")
    gone_id = rows[2].split(",")[0]
    assert run_cli("--source", tiny_model_dir, "--manifest", broken, "--data_root", clean,
                   "--out", tmp_path / "x.pt") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ERROR: {broken}: utterance {gone_id}: ") and "file not found" in err
    assert not (tmp_path / "x.pt").exists()
    # a manifest without a wav column was a KeyError traceback
    nowav = tmp_path / "nowav.csv"
    nowav.write_text("\n".join([rows[0].replace(",wav,", ",path,")] + rows[1:3]) + "\n")
    assert run_cli("--source", tiny_model_dir, "--manifest", nowav, "--data_root", clean,
                   "--out", tmp_path / "x.pt") == 1
    assert capsys.readouterr().err.strip().startswith(
        f"ERROR: {nowav}: missing required column(s) wav (found: ID, duration, path, ")
    folder = tmp_path / "stats"          # was computed, then '[Errno 21]' and a .tmp file left
    folder.mkdir()
    with pytest.raises(SystemExit):
        run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root",
                clean, "--out", folder)
    assert f"--out {folder}: is a folder; it names the statistics file" in capsys.readouterr().err
    with pytest.raises(OSError, match=f"is a folder, not a file name: '{folder}'"):
        ss.save(rec, folder)
    assert not list(tmp_path.glob("stats.tmp*"))
    # a statistics file that cannot be written is a failure (exit 1), after the computation
    (tmp_path / "afile").write_text("")
    assert run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root",
                   clean, "--out", tmp_path / "afile" / "x.pt", "--max_utts", 1) == 1
    assert capsys.readouterr().err.startswith(f"ERROR: cannot write {tmp_path / 'afile' / 'x.pt'}: ")
    # a kind option without a value is not taken as an empty one
    with pytest.raises(SystemExit):
        run_cli("--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--out",
                tmp_path / "x.pt", "--params")
    assert "unrecognized argument '--params' (kind options are --key=value)" in \
        capsys.readouterr().err


def test_an_utterance_too_short_for_the_model_is_named(clean, tiny_model_dir, tmp_path,
                                                      capsys):
    """A clean manifest holding a file too short for the model (10 ms: no output frame) names
    the manifest, the utterance and the file; it was the convolution's own error, which named
    none of them ("Kernel size can't be greater than actual input size")."""
    rows = (clean / "stream.csv").read_text().splitlines()
    first = read_manifest(clean / "stream.csv", replacements={"data_root": str(clean)})[0]
    sf.write(tmp_path / "short.wav", load_audio(first["wav"]).numpy()[:160], 16000)
    short = tmp_path / "short.csv"
    short_id, _, _, *rest = rows[2].split(",")
    cut = ",".join([short_id, "0.01", str(tmp_path / "short.wav"), *rest])
    short.write_text("\n".join(rows[:2] + [cut]) + "\n")
    for kinds in ("fisher", "hidden"):
        assert run_cli("--source", tiny_model_dir, "--manifest", short, "--data_root", clean,
                       "--kinds", kinds, "--out", tmp_path / "x.pt") == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"ERROR: {short}: utterance {short_id}: {tmp_path / 'short.wav'}: "
                              f"too short for the model (160 samples give no output frame)"), err
        assert len(err.splitlines()) == 1
    assert not (tmp_path / "x.pt").exists()


def test_clean_rows_keep_an_utterance_exactly_max_duration_long(clean):
    """--max_duration leaves out the longer utterances: one exactly that long is used."""
    rows = read_manifest(clean / "stream.csv", replacements={"data_root": str(clean)})
    limit = float(rows[0]["duration"])
    kept = [r["ID"] for r in ss.clean_rows(str(clean / "stream.csv"), str(clean),
                                           max_duration=limit)]
    assert rows[0]["ID"] in kept
    assert kept == [r["ID"] for r in rows if float(r["duration"]) <= limit] != \
        [r["ID"] for r in rows]


def test_reuse_recomputes_for_an_audio_file_rewritten_in_place(clean, tiny_model_dir, tmp_path,
                                                               capsys):
    """The same manifest, data root and paths, but a wav written again with another length (a
    re-export): the file's statistics are of the old audio, so --reuse computes them again."""
    root = tmp_path / "root"
    shutil.copytree(clean, root)
    out = tmp_path / "f.pt"
    argv = ["--source", tiny_model_dir, "--manifest", root / "stream.csv", "--data_root", root,
            "--out", out, "--max_utts", 1, "--reuse"]
    assert run_cli(*argv) == 0 and "no file yet, computing" in capsys.readouterr().out
    wav = root / read_manifest(root / "stream.csv")[0]["wav"].replace("$data_root/", "")
    audio, sr = sf.read(wav)
    sf.write(wav, audio[: len(audio) // 2], sr)
    assert run_cli(*argv) == 0
    assert "other audio files (--data_root, --max_duration)" in capsys.readouterr().out


def test_paths_and_identity(tmp_path):
    assert expand_path("$data_root/a/s.pt", "/d") == "/d/a/s.pt"
    assert expand_path("${data_root}/s.pt", "/d") == "/d/s.pt"
    f = tmp_path / "s.pt"
    assert file_identity(expand_path("$data_root/s.pt", str(tmp_path))) == f"missing:{f}"
    f.write_bytes(b"abc")
    assert file_identity(expand_path("$data_root/s.pt", str(tmp_path))) == f"sha1:{file_sha1(f)}"


def test_an_input_file_is_hashed_once_a_process_until_it_changes(tmp_path, monkeypatch):
    """Every run's fingerprint hashes its input files (SGEM's lm_path: a KenLM binary of a few
    GB); a grid plans all its runs in one process, and read the file again for each run."""
    from tta_brain.data import cache
    monkeypatch.setattr(cache, "RACY_MARGIN_NS", -10 ** 12)    # (written now: hashed each time)
    f = tmp_path / "lm.bin"
    f.write_bytes(b"abc")
    reads = []
    real = cache.file_sha1
    monkeypatch.setattr(cache, "file_sha1", lambda p, *a: reads.append(p) or real(p, *a))
    first = file_identity(str(f))
    assert [file_identity(str(f)) for _ in range(5)] == [first] * 5 and len(reads) == 1
    f.write_bytes(b"abcd")                      # changed: hashed again
    assert file_identity(str(f)) == f"sha1:{real(f)}" != first and len(reads) == 2
    st = f.stat()
    time.sleep(0.05)                            # (the next write in another clock tick)
    f.write_bytes(b"abce")                      # the same size, its old mtime put back (cp -p):
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))        # the change time still moved
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    assert file_identity(str(f)) == f"sha1:{real(f)}" and len(reads) == 3
    f.unlink()
    assert file_identity(str(f)) == f"missing:{f}"
    assert file_identity(str(tmp_path)) == f"missing:{tmp_path}"      # a folder: no input file


def test_an_input_file_changed_just_now_is_hashed_each_time(tmp_path, monkeypatch):
    """A file changed within RACY_MARGIN_NS is not trusted to its stat (a change in the same
    clock tick on a coarse-timestamp file system keeps it): every call reads it."""
    from tta_brain.data import cache
    f = tmp_path / "lm.bin"
    f.write_bytes(b"abc")
    reads = []
    real = cache.file_sha1
    monkeypatch.setattr(cache, "file_sha1", lambda p, *a: reads.append(p) or real(p, *a))
    assert [file_identity(str(f)) for _ in range(3)] == [f"sha1:{real(f)}"] * 3
    assert len(reads) == 3


def test_a_model_folder_changed_just_now_is_hashed_each_time(tmp_path, monkeypatch):
    """The same for a model folder (source_identity): a file written within RACY_MARGIN_NS is
    read on every call, not answered by its stat (which a second write in the same clock tick of
    a coarse-timestamp file system, with the same size, would keep)."""
    from tta_brain.data import cache
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"a" * 64)
    (model / "config.json").write_text("{}")
    reads = []
    real = cache.file_sha1
    monkeypatch.setattr(cache, "file_sha1", lambda p, *a: reads.append(p) or real(p, *a))
    assert len({source_identity(str(model)) for _ in range(3)}) == 1
    assert len(reads) == 3 * 2


def test_a_model_folder_copied_over_with_its_mtime_kept_is_hashed_again(tmp_path):
    """source_identity is cached a process by the files' stat: a same-size weights file copied
    in with its old mtime (cp -p, rsync -t, tar x) kept the first model's identity in that
    process (a notebook's second decode skipped as finished; a fresh process said it differs)."""
    import os
    import time
    model = tmp_path / "m"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    (model / "config.json").write_text("{}")
    old = time.time_ns() - 10 ** 10                  # written long ago: cacheable
    for f in model.iterdir():
        os.utime(f, ns=(old, old))
    time.sleep(0.01)
    first = source_identity(str(model))
    before = weights.stat()
    weights.write_bytes(b"b" * 64)                   # other weights, the same size and mtime
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert source_identity(str(model)) != first


def test_a_model_folder_copied_over_long_ago_in_this_process_is_hashed_again(tmp_path,
                                                                             monkeypatch):
    """The same as above once the copy is older than RACY_MARGIN_NS (a notebook's next decode
    minutes later): the stat cache must see the new change time, the mtime being the old one."""
    import os
    import time
    from tta_brain.data import cache
    model = tmp_path / "m"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    (model / "config.json").write_text("{}")
    old = time.time_ns() - 10 ** 10
    for f in model.iterdir():
        os.utime(f, ns=(old, old))
    monkeypatch.setattr(cache, "RACY_MARGIN_NS", -10 ** 12)     # nothing counts as just changed
    first = source_identity(str(model))
    before = weights.stat()
    time.sleep(0.01)
    weights.write_bytes(b"b" * 64)                   # other weights, the same size and mtime
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert source_identity(str(model)) != first


def test_module_entry_point_help():
    res = subprocess.run([sys.executable, "-m", "tta_brain.stats", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--kinds" in res.stdout and "--manifest" in res.stdout
    assert "fisher (eata), hidden (foa; ebats with tokens), tokens (ebats)" in " ".join(
        res.stdout.split())


def test_reuse_keeps_a_current_file_and_recomputes_a_stale_one(clean, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "f.pt"
    argv = ["--source", tiny_model_dir, "--manifest", clean / "stream.csv", "--data_root", clean,
            "--out", out, "--max_utts", 2, "--reuse"]
    assert run_cli(*argv) == 0 and "no file yet, computing" in capsys.readouterr().out
    stamp = out.stat().st_mtime_ns
    assert run_cli(*argv) == 0 and "up to date" in capsys.readouterr().out
    assert out.stat().st_mtime_ns == stamp
    assert run_cli(*argv[:-1]) == 0 and "up to date" not in capsys.readouterr().out  # no --reuse
    # more kinds than the file holds: computed; fewer: kept
    assert run_cli(*argv, "--kinds", "fisher,hidden") == 0
    assert "other kinds or options" in capsys.readouterr().out
    assert ss.load(out).kinds == ["fisher", "hidden"]
    assert run_cli(*argv) == 0 and "up to date" in capsys.readouterr().out   # fewer: kept
    assert run_cli(*argv[:-2], 3, "--reuse") == 0
    assert "another number of utterances" in capsys.readouterr().out and ss.load(out).n_utts == 3
    assert run_cli(*argv, "--params=cnn") == 0 and "other kinds or options" in capsys.readouterr().out
    # the same manifest and count, other audio: kept before (its fisher was of the old audio)
    argv = argv[:-1] + ["--params=cnn", "--reuse"]
    assert run_cli(*argv) == 0 and "up to date" in capsys.readouterr().out
    other = tmp_path / "other_root"
    shutil.copytree(clean, other)
    wav = sorted(other.rglob("*.wav"))[0]
    sf.write(wav, 0.5 * sf.read(wav)[0], 16000)
    old = ss.load(out).stats["fisher"]
    assert run_cli(*argv[:5], other, *argv[6:]) == 0
    assert "other audio files (--data_root, --max_duration)" in capsys.readouterr().out
    assert any(not torch.equal(old[k], v) for k, v in ss.load(out).stats["fisher"].items())
    # durations 0.427, 0.308, 0.463, 0.421, ...: two utterances still, but not the same two
    assert run_cli(*argv[:5], other, *argv[6:], "--max_duration", 0.425) == 0
    assert "other audio files" in capsys.readouterr().out and ss.load(out).n_utts == 2
    assert run_cli(*argv[:5], other, *argv[6:], "--max_duration", 0.425) == 0   # computed on them
    assert "up to date" in capsys.readouterr().out
    # another model, a manifest that is not there: computed
    from conftest import save_ctc_model
    other_model = save_ctc_model(str(tmp_path / "other_model"), seed=1)
    assert run_cli(*argv[:1], other_model, *argv[2:]) == 0
    assert "another model" in capsys.readouterr().out
    assert ss.load(out).model == source_identity(other_model)
    assert run_cli(*argv[:3], tmp_path / "no.csv", *argv[4:]) == 1
    assert "another manifest content, computing" in capsys.readouterr().out
