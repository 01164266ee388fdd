"""The run fingerprint's rules from tta_brain.run.identity's docstrings: where a run is written
and how often it checkpoints are no part of it, ``device`` counts by its type, an old block
digest is renamed only to the digest it computed the same as, and one's own edited code is
another run (a host where the code is not found takes the recorded digest as not known)."""
import json

from tta_brain.run.identity import differences, fingerprint


def hp(**kw):
    return {"seed": 0, "lr": 1e-4, "steps": 1, "method_tag": "suta", "stream_name": "AC",
            "output_folder": "/a", "stream_csv": "/s.csv", "data_root": "/d", "ckpt_every": 50,
            "device": "cpu", **kw}


def test_location_and_checkpoint_frequency_are_no_part_of_a_run(tmp_path):
    csv = tmp_path / "s.csv"
    csv.write_text("ID\nu0\n")
    a = fingerprint(hp(), csv, 1)
    b = fingerprint(hp(output_folder="/b", data_root="/e", ckpt_every=0, method_tag="x"), csv, 1)
    assert a == b and differences(a, b) == []
    assert differences(a, fingerprint(hp(lr=2e-4), csv, 1)) == ["hparams.lr: 0.0001 != 0.0002"]
    # a key one run has and the other lacks (one's own yaml's, a key added since) differs too
    assert differences(a, fingerprint(hp(em_coef=0.3), csv, 1)) == [
        "hparams.em_coef: '(unset)' != 0.3"]


def test_device_counts_by_its_type_not_its_index(tmp_path):
    csv = tmp_path / "s.csv"
    csv.write_text("ID\nu0\n")
    on = {d: fingerprint(hp(device=d), csv, 1) for d in ("cuda:0", "cuda:1", "cuda", "cpu")}
    assert on["cuda:0"] == on["cuda:1"] == on["cuda"]
    assert differences(on["cuda:1"], on["cuda:0"]) == []
    assert differences(on["cpu"], on["cuda:0"]) == ["hparams.device: 'cpu' != 'cuda'"]


def test_only_the_renamed_digest_itself_is_the_old_blocks_digest():
    now = {"hparams": {"seed": 0}, "structure": {"adapt_params": "05ffdd77049c"}}
    old = json.loads(json.dumps(now))
    old["structure"]["adapt_params"] = "f7addc96ee81"         # cea.yaml before 11691bf
    assert differences(old, now) == []
    edited = json.loads(json.dumps(now))                      # cea.yaml's block edited since
    edited["structure"]["adapt_params"] = "0123456789ab"
    assert differences(old, edited) == ["structure.adapt_params: 'f7addc96ee81' != '0123456789ab'"]
    assert differences(old, edited, recorded=True) != []


def test_ones_own_code_edited_is_another_run():
    old = {"hparams": {"seed": 0}, "code": {"mymethod": "sha1:aaa"}}
    edited = {"hparams": {"seed": 0}, "code": {"mymethod": "sha1:bbb"}}
    assert differences(old, edited) == ["code.mymethod: 'sha1:aaa' != 'sha1:bbb'"]
    assert differences(old, edited, recorded=True) != []
    not_found_here = {"hparams": {"seed": 0}}
    assert differences(old, not_found_here) == []


def test_a_local_source_model_counts_by_its_files_not_its_path(tmp_path):
    """A model folder copied elsewhere is the same run; its weights changed in place are
    another (a retrained model at the same path was skipped as finished)."""
    import shutil
    csv = tmp_path / "s.csv"
    csv.write_text("ID\nu0\n")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    shutil.copytree(model, tmp_path / "copy")
    a = fingerprint(hp(source=str(model)), csv, 1)
    assert differences(a, fingerprint(hp(source=str(tmp_path / "copy")), csv, 1)) == []
    (model / "model.safetensors").write_bytes(b"\1" * 64)
    assert [d.split(":")[0] for d in differences(a, fingerprint(hp(source=str(model)), csv, 1))] \
        == ["hparams.source"]


def test_a_hub_model_recorded_without_its_commit_is_not_another_run():
    """A run recorded ``hub:<name>`` (before commits were, or before the model was cached) is
    this run on ``hub:<name>@<commit>``: what it ran on is not known; another commit differs."""
    old = {"hparams": {"seed": 0, "source": "hub:org/model"}}
    now = {"hparams": {"seed": 0, "source": "hub:org/model@abc"}}
    assert differences(old, now) == []
    other = {"hparams": {"seed": 0, "source": "hub:org/model@def"}}
    assert differences(now, other) == ["hparams.source: 'hub:org/model@abc' != 'hub:org/model@def'"]
