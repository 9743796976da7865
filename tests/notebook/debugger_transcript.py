"""Reading a rank's debugger answers out of a cell's output."""

from __future__ import annotations


def debugger_answers(transcript: str, rank: int) -> list[str]:
    """What rank ``rank``'s debugger printed for ``p <int variable>`` commands, in order:
    the transcript without that rank's prompts and without the other ranks' streamed lines.

    Stepping lets the other ranks run on, so their output may land anywhere between the
    rank's prompts (nothing echoes a piped command to separate them).
    """
    prompt = f"(rank {rank} Pdb) "
    lines = (line.replace(prompt, "").strip() for line in transcript.splitlines())
    return [line for line in lines if line.isdigit()]
