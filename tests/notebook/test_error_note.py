"""ErrorNote: what a view shows for a failed click (no ranks needed)."""

from __future__ import annotations

from fsdp_interactive.notebook._error_note import ErrorNote
from fsdp_interactive.pool.errors import RankError

REMOTE = """\
---------------------------------------------------------------------------
RuntimeError                              Traceback (most recent call last)
Cell In[7], line 3
----> 3 _fsdp_interactive_probe = _fsdp_interactive_inspect.edit_param(m, 'w', 'x.view(3, 7)')

File /venv/site-packages/fsdp_interactive/inspect/_summon.py:151, in edit_param(model, fqn, expression)
--> 151     result = eval(code, namespace)

File <edit>:1
----> 1 x.view(3, 7)

RuntimeError: shape '[3, 7]' is invalid for input of size 15
"""


def test_rank_errors_keep_the_exception_line_and_the_users_frame_only():
    error = RankError(
        {0: REMOTE, 1: REMOTE},
        {
            0: ("RuntimeError", "shape '[3, 7]' is invalid"),
            1: ("RuntimeError", "shape '[3, 7]' is invalid"),
        },
    )
    note = ErrorNote.of(error)
    assert note.headline == "ranks 0, 1: RuntimeError: shape '[3, 7]' is invalid"
    assert note.frames == ("File <edit>:1\n----> 1 x.view(3, 7)",)
    html = note.html("edit failed: ")
    assert html.index("RuntimeError") < html.index("<details>")
    assert "edit_param" not in html


def _library_only():
    import json

    json.loads("{not json")


def test_local_errors_without_user_frames_show_where_they_were_raised():
    try:
        _library_only()
    except ValueError as error:
        note = ErrorNote.of(error)
    assert note.headline.startswith("JSONDecodeError: Expecting property name")
    # this test file is user code: its frames stay, json's do not
    assert all("json/decoder.py" not in frame for frame in note.frames)
    assert any("_library_only" in frame for frame in note.frames)
    try:
        raise KeyError("k")
    except KeyError as error:
        assert ErrorNote.of(error).headline == "KeyError: 'k'"
