"""One's own code in the fingerprint (mutation audit): an edited module is another run; a host
where the code is not found (a grid's) takes the recorded digest as not known."""
from tta_brain.run.identity import differences


def test_ones_own_code_edited_is_another_run():
    old = {"hparams": {"seed": 0}, "code": {"mymethod": "sha1:aaa"}}
    edited = {"hparams": {"seed": 0}, "code": {"mymethod": "sha1:bbb"}}
    assert differences(old, edited) == ["code.mymethod: 'sha1:aaa' != 'sha1:bbb'"]
    assert differences(old, edited, recorded=True) != []
    not_found_here = {"hparams": {"seed": 0}}
    assert differences(old, not_found_here) == []
