"""The packaged yamls and their one validation source (tta_brain.hparams.rules)."""
import re

import pytest

from tta_brain import hparams

REQUIRED = "source: x\nstream_csv: y\noutput_folder: z\nsource_stats: s\n"


@pytest.mark.parametrize("method", hparams.available())
def test_every_key_of_every_packaged_yaml_has_a_rule_and_its_default_passes(method):
    keys = [k for k, _, _ in hparams.describe(method)]
    assert keys and [k for k in keys if k not in hparams.RULES] == []
    overrides = "".join(line + "\n" for line in REQUIRED.splitlines()
                        if line.split(":")[0] in hparams.keys(method))
    values = hparams.resolve(method, overrides).values
    assert values["method"] is not None
    from tta_brain.run.identity import your_code            # all of it the package's or a
    mods = hparams.imported_modules(values)                 # library's: no code in the
    assert "tta_brain.methods" in mods and your_code(values) == {}      # fingerprint


@pytest.mark.parametrize("key,value,expected", [
    ("eata_optimizer", "adam", "eata_optimizer must be one of adamw, sgd"),
    ("restore_mask", "random", "restore_mask must be one of fresh, fixed"),
    ("population_batch", -1, "population_batch must be an integer >= 0"),
    ("filter_K", 0, "filter_K must be an integer >= 1 (or -1: all)"),
    ("popsize", 1, "popsize must be an integer >= 2"),
    ("source", 3, "source must be a string"),
    ("reset_K", 3, "reset_K must be an integer >= 4"),
    ("reset_K", 4.0, "reset_K must be an integer >= 4"),
    ("lr", 0, "lr must be a number > 0"),
    ("lr", float("nan"), "lr must be a number > 0"),
    ("reset_threshold", float("inf"), "reset_threshold must be a number ("),
    ("steps", True, "steps must be an integer >= 0"),
    ("em_coef", 1.5, "em_coef must be a number between 0 and 1"),
    ("seed", 2 ** 32, "seed must be an integer between 0 and 4294967295"),
    pytest.param("seed", 10 ** 400, "seed must be an integer between 0 and 4294967295",
                 id="seed-too-big-for-a-float"),      # was math.isfinite's OverflowError
    pytest.param("steps", -10 ** 400, "steps must be an integer >= 0", id="steps-huge-negative"),
    ("train_mode", 1, "train_mode must be true or false"),
    ("cuda_graph_cache", 2.5, "cuda_graph_cache must be auto or an integer >= 1"),
    ("lr", None, "lr must be a number > 0"),           # null is slow_lr's only (">0?")
])
def test_a_bad_value_names_the_key_what_it_must_be_and_what_it_means(key, value, expected):
    method = next(m for m in hparams.available() if key in hparams.keys(m))
    with pytest.raises(hparams.HparamsError, match=re.escape(expected)) as err:
        hparams.check(hparams.find(method), {key: value})
    comment = dict((k, c) for k, _, c in hparams.describe(method))[key]
    assert comment and comment in str(err.value) and "\n" not in str(err.value)
    hparams.check(hparams.find(method), {"filter_K": -1, "popsize": 2, "reset_K": 4, "em_coef": 1,
                                         "ema_decay": 0, "seed": 2 ** 32 - 1, "lr": 1e-9,
                                         "slow_lr": None, "cuda_graph_cache": "auto"})  # edges


def test_a_file_error_in_a_constructor_names_the_file():
    """An ``OSError`` of a file, raised in a yaml's constructor, was ``2: No such file or
    directory`` (its args), without the file."""
    from tta_brain.hparams import _describe
    assert _describe(FileNotFoundError(2, "No such file or directory", "/x/words.txt")) == \
        "/x/words.txt: No such file or directory"
    assert _describe(FileNotFoundError("lm_unigrams /x: no such file")) == \
        "lm_unigrams /x: no such file"
    assert _describe(ValueError("a", "b\n c")) == "a: b c"


def test_your_code_is_your_own_top_level_modules_and_packages(tmp_path, monkeypatch):
    """What a run fingerprints as your own code: the top-level package of a dotted import (an
    edit of a sibling module counts), the dict form of import_module too; a package whose
    import raises is hashed, not imported (find_spec of a dotted name imported it: a traceback
    here, before the yaml's build could report it in one line); an installed
    distribution's package (an editable SpeechBrain) is a version, not your code."""
    import ruamel.yaml
    from tta_brain.run import identity
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "methods.py").write_text("X = 1\n")
    (tmp_path / "single.py").write_text("Y = 2\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "__init__.py").write_text("raise RuntimeError('needs CUDA 12')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    values = ruamel.yaml.YAML().load(
        "a: !apply:importlib.import_module [mypkg.methods]\n"
        "b: !apply:importlib.import_module {name: single}\n"
        "c: !new:broken.thing.Class\n    x: 1\n"
        "d: !name:torch.optim.AdamW\n")
    assert hparams.imported_modules(values) == ["mypkg.methods", "single", "broken.thing",
                                                "torch.optim"]
    code = identity.your_code(values)         # (top-level names: nothing is imported)
    assert sorted(code) == ["broken", "mypkg", "single"] and code["mypkg"]["file"] == str(pkg)
    (pkg / "other.py").write_text("Z = 3\n")              # a sibling of the imported module
    assert identity.your_code(values)["mypkg"]["sha1"] != code["mypkg"]["sha1"]
    assert identity.your_code(values)["single"] == code["single"]
    monkeypatch.setattr(identity, "_installed", lambda: {"mypkg": ["mypkg"]})
    assert sorted(identity.your_code(values)) == ["broken", "single"]


def test_an_override_that_only_matters_under_another_value_is_refused():
    """EATA's momentum is read only by its SGD optimiser: --momentum under the default AdamW
    decoded exactly the default run, under another name and fingerprint; now one line. With
    eata_optimizer=sgd it is taken."""
    base = {"source": "m", "stream_csv": "s.csv", "output_folder": "o"}
    with pytest.raises(hparams.HparamsError,
                       match=r"momentum = 0.5 \(an override\) with eata_optimizer = 'adamw': it is "
                             r"only used with eata_optimizer = sgd"):
        hparams.resolve("eata", {**base, "momentum": 0.5})
    values = hparams.resolve("eata", {**base, "momentum": 0.5, "eata_optimizer": "sgd"}).values
    assert values["momentum"] == 0.5
    for key, value in (("reset_test_size", 5), ("reset_K", 20), ("reset_every", 3)):
        with pytest.raises(hparams.HparamsError, match=rf"{key} = {value} \(an override\) with "
                                                       r"reset = 'none': it is only used"):
            hparams.resolve("csuta", {**base, key: value})
    with pytest.raises(hparams.HparamsError, match=r"reset_every = 3 \(an override\) with "
                       r"reset = 'dynamic': it is only used with reset = fixed"):
        hparams.resolve("csuta", {**base, "reset": "dynamic", "reset_every": 3})
    with pytest.raises(hparams.HparamsError, match=r"lm_weight = 0.3 \(an override\) without "
                                                   r"lm_path"):      # the yaml's lm_path: null
        hparams.resolve("sgem", {**base, "lm_weight": 0.3})
    assert hparams.resolve("csuta", {**base, "reset": "dynamic",
                                     "reset_test_size": 5}).values["reset_test_size"] == 5


@pytest.mark.parametrize("reset", ["none", "fixed", "dynamic", "oracle"])
def test_a_reset_policy_the_method_never_gets_is_refused(tmp_path, reset):
    """A yaml of one's own that includes the reset block but leaves ``reset_policy`` out of
    its method: entry ran every policy as reset none, labelled with the policy; each policy
    other than none is one line (the test beside decode's checked oracle only)."""
    text = hparams.find("csuta").read_text().replace("    reset_policy: !ref <reset_policy>\n", "")
    own = tmp_path / "mycsuta.yaml"
    own.write_text(text)
    base = {"source": "m", "stream_csv": "s.csv", "output_folder": "o", "reset": reset}
    if reset == "none":
        assert hparams.resolve(str(own), base).values["reset"] == "none"
        return
    with pytest.raises(hparams.HparamsError, match=rf"reset = '{reset}' builds a reset policy "
                                                   r"the method never gets"):
        hparams.resolve(str(own), base)


def test_a_device_of_another_machine_is_checked_for_its_form_only():
    """A Slurm grid's dry run checks runs that decode on a GPU node: cuda is no error here."""
    for device in ("cuda", "cuda:3", "cpu"):
        hparams.check_device(device, here=False)
    for device in ("gpu", "cuda:x", "cuda:", "", None):
        with pytest.raises(hparams.HparamsError, match=r"is not valid: use cpu, cuda or cuda:N"):
            hparams.check_device(device, here=False)


def test_an_override_nothing_in_the_yaml_reads_is_refused(tmp_path):
    """A key of one's own yaml that never reaches its class (no ``!ref <min_conf>`` under
    method:), and the reset block's keys in a yaml that builds its own reset_policy: an
    override of either decoded the same run under another name and fingerprint (a grid's
    ``mine+oracle`` folder ran the yaml's own policy, labelled oracle); now one line naming
    the key. A key read through a reference, or a run key the code reads by name, is taken."""
    csuta = hparams.find("csuta").read_text()
    own = tmp_path / "mine.yaml"
    own.write_text(csuta + "min_conf: 0.5\n"
                   "reset_policy: !new:tta_brain.methods.resets.FixedReset\n    every: 3\n")
    base = {"source": "m", "stream_csv": "s.csv", "output_folder": "o"}
    with pytest.raises(hparams.HparamsError,
                       match=r"--min_conf would not change the run: nothing in this yaml reads "
                             r"it \(no !ref <min_conf>; a key of your own reaches your class"):
        hparams.resolve(own, {**base, "min_conf": 0.9})
    with pytest.raises(hparams.HparamsError,
                       match=r"--reset would not change the run: nothing in this yaml reads "
                             r"it \(only the label method_tag names it; .*reset_policy, which this "
                             r"yaml replaces with its own"):
        hparams.resolve(own, {**base, "reset": "oracle"})
    values = hparams.resolve(own, {**base, "lr": 1e-3, "seed": 3, "max_duration": 5.0,
                                   "method_tag": "x"}).values
    assert values["lr"] == 1e-3 and values["seed"] == 3
    for method in hparams.available():            # every packaged key is read
        keys = [k for k in hparams.keys(method) if not k.startswith("__")
                and k not in hparams.BUILT_KEYS and k not in ("reset_policy",)]
        hparams._check_read(hparams.find(method),
                            [t for t, _, _ in hparams.composed_lines(hparams.find(method))], keys)
        # an object the code reads by name, replaced by another built one (--method=!new:...)
        hparams._check_read(hparams.find(method),
                            [t for t, _, _ in hparams.composed_lines(hparams.find(method))],
                            list(hparams.BUILT_KEYS))


def test_a_reference_to_a_key_the_yaml_lacks_says_where_and_the_closest_key(tmp_path):
    """``lrr: 1e-4`` above ``lr: !ref <lr>``: hyperpyyaml's 'The reference "lr" is not valid'
    said neither where the reference is nor that the key was misspelt."""
    text = hparams.find("tent").read_text().replace("\nlr: 2.0e-5", "\nlrr: 2.0e-5")
    own = tmp_path / "mine.yaml"
    own.write_text(text)
    line = next(n for n, t in enumerate(text.splitlines(), 1) if "!ref <lr>" in t)
    with pytest.raises(hparams.HparamsError,
                       match=re.escape(f"{own}: !ref <lr> at {own}:{line} names no key of this "
                                       f"yaml (no top-level 'lr:'; did you mean lrr?)")):
        hparams.resolve(own, {"source": "m", "stream_csv": "s.csv", "output_folder": "o"})


def test_a_key_the_yaml_sets_itself_leaves_its_blocks_list_whole(tmp_path):
    """A block of one's own (``include: [run, mine.yaml]``) whose list is written with its items
    at column 0 (``layers:`` then ``- a``): the yaml's own ``layers`` wins and takes the block's
    items out with the key (left behind, they were read as items of the block's previous key)."""
    (tmp_path / "mine.yaml").write_text("layers:\n- a\n- b\nextra: 1\n")
    own = tmp_path / "own.yaml"
    own.write_text("include: [mine.yaml]\nlayers: [c]\n")
    import ruamel.yaml
    composed = hparams.compose(own)
    assert ruamel.yaml.YAML().load(composed) == {"layers": ["c"], "extra": 1}
    assert "- a" not in composed and "- b" not in composed


def test_a_structure_digest_is_the_blocks_values_and_tags_whatever_their_order(tmp_path):
    """A run's fingerprint holds a digest of each nested block (``structure``): the same block
    with its keys in another order, with comments, or with a reference to a key added to the
    packaged yamls later (``added``) is the same digest, so older run folders stay "the same
    settings"; another value or class is another digest. The digest is pinned: sha1 of the
    block's JSON (tags as ``{"!": tag, "=": value}``, keys sorted), 12 hex digits."""
    import hashlib
    import json
    a, b, c = (tmp_path / f"{n}.yaml" for n in "abc")
    a.write_text("lr: 1\nflag: true\nmethod: !new:x.Y\n    lr: !ref <lr>\n    steps: 3\n"
                 "    on: true\n")
    b.write_text("lr: 1\nflag: true\nmethod: !new:x.Y   # mine\n    on: true\n    steps: 3\n"
                 "    lr: !ref <lr>\n")
    c.write_text("lr: 1\nflag: true\nconvolutions: native\nmethod: !new:x.Y\n    steps: 3\n"
                 "    convolutions: !ref <convolutions>\n    on: true\n    lr: !ref <lr>\n")
    by_hand = json.dumps({"!": "!new:x.Y", "=": {"lr": {"!": "!ref", "=": "<lr>"}, "on": True,
                                                 "steps": 3}}, sort_keys=True)
    digest = hashlib.sha1(by_hand.encode()).hexdigest()[:12]
    assert hparams.structure(a, ["method", "absent"]) == {"method": digest}
    assert hparams.structure(b, ["method"]) == {"method": digest}
    assert hparams.structure(c, ["method"], added=["convolutions"]) == {"method": digest}
    assert hparams.structure(c, ["method"]) != {"method": digest}
    other = "method: !new:x.Y\n    lr: !ref <lr>\n    steps: 4\n    on: true\n"
    assert hparams.structure(a, ["method"], other) != {"method": digest}
    assert hparams.structure(a, ["method"], other.replace("steps: 4", "steps: 3")) == \
        {"method": digest}


def test_the_dynamic_resets_K_must_reach_past_the_first_meta_update():
    """phi_D is saved after K/2 utterances: before the first meta-update (every buffer_size M)
    it is the source model and the reset never fires. K = 2M is the smallest K that works."""
    path = hparams.find("dsuta")
    hparams.check(path, {"reset": "dynamic", "reset_K": 10, "buffer_size": 5})
    with pytest.raises(hparams.HparamsError, match=r"reset_K = 9 with buffer_size = 5: .* use "
                                                   r"reset_K >= 10"):
        hparams.check(path, {"reset": "dynamic", "reset_K": 9, "buffer_size": 5})
    hparams.check(path, {"reset": "dynamic", "reset_K": 5, "reset_lii_count": "official"})
    with pytest.raises(hparams.HparamsError, match=r"reset_K = 4 with reset_lii_count = official "
                                                   r"is not valid: .* use reset_K >= 5"):
        hparams.check(path, {"reset": "dynamic", "reset_K": 4, "reset_lii_count": "official"})
    hparams.check(path, {"reset": "fixed", "reset_K": 9, "buffer_size": 5})    # K unread


def test_a_range_given_upside_down_is_refused():
    """CoTTA's noise amplitude range with its ends swapped drew from the same range under
    labels that said otherwise; now one line naming both keys (equal ends: one amplitude)."""
    path = hparams.find("cotta")
    with pytest.raises(hparams.HparamsError, match=r"cotta.yaml: noise_min = 0.02 is above "
                                                   r"noise_max = 0.015: noise_min is the lower"):
        hparams.resolve(path, {"source": "m", "stream_csv": "s.csv", "output_folder": "o",
                               "noise_min": 0.02})
    hparams.check(path, {"noise_min": 0.01, "noise_max": 0.01})
    # SGEM's cosine schedule anneals lr towards lr_min: an lr under the default lr_min (2e-5)
    # climbed over the steps instead (equal: a constant lr)
    sgem = {"source": "m", "stream_csv": "s.csv", "output_folder": "o"}
    with pytest.raises(hparams.HparamsError, match=r"sgem.yaml: lr_min = 2e-05 is above "
                                                   r"lr = 1e-05: lr_min is the lower end"):
        hparams.resolve("sgem", dict(sgem, lr=1e-5))
    assert hparams.resolve("sgem", dict(sgem, lr=2e-5)).values["lr_min"] == 2e-5
    assert hparams.resolve("sgem", dict(sgem, lr=1e-5, lr_min=1e-6)).values["lr"] == 1e-5


def test_a_packaged_method_included_without_its_blocks_names_them(tmp_path):
    """``include: [suta]`` (a method yaml, to override a key of it) took suta.yaml without the
    ``run`` block its own include line names (includes are not followed), and was refused as
    ``Override 'source' not found``; now one line naming the block to list. ``[run, suta]``
    composes as before, suta's own ``include`` line left inert and out of ``--help``."""
    own = tmp_path / "own.yaml"
    own.write_text("include: [suta]\nsteps: 1\n")
    with pytest.raises(hparams.HparamsError, match=re.escape(
            "own.yaml: include 'suta' (suta.yaml) includes run itself; includes are not "
            "followed: list it in this file's include line (include: [run, suta])")):
        hparams.resolve(own, {"source": "m", "stream_csv": "s.csv", "output_folder": "o"})
    own.write_text("include: [run, suta]\nsteps: 1\n")
    values = hparams.resolve(own, {"source": "m", "stream_csv": "s.csv",
                                   "output_folder": "o"}).values
    assert values["steps"] == 1 and values["seed"] == 0
    # suta's own include line, left in, is no key: --help listed --include (an override of it
    # is refused: nothing reads it)
    described = [k for k, _, _ in hparams.describe(own)]
    assert "steps" in described and "seed" in described and "include" not in described
