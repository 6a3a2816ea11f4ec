"""A journal's images as content-addressed files (``policy.image_store = "files"``)."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import anyio
import pytest

from fleetroll.pool.journal import (
    Journal,
    images_folder,
    inline_images,
    read_journal,
    rebased_images,
)
from fleetroll.results import RolloutResult, Trajectory, Turn, TurnImage
from fleetroll.training.trajectory import row_images, training_rows


def image(png: bytes, start: int) -> TurnImage:
    return TurnImage(
        start=start,
        end=start + 2,
        width=56,
        height=28,
        sha256=hashlib.sha256(png).hexdigest(),
        data=base64.b64encode(png).decode("ascii"),
    )


def result(n: int, pngs: list[bytes]) -> RolloutResult:
    """A scored rollout of two turns: the first shows ``pngs[0]``, the second all of them."""
    first = [image(pngs[0], 1)]
    both = [image(png, 1 + 3 * i) for i, png in enumerate(pngs)]
    ids = [0, 9, 9, 0, 9, 9, 0, 5]
    return RolloutResult(
        rollout_id=f"r{n}",
        batch_id="b",
        task_key="t",
        group_id="g",
        env_key="desktop",
        modality="computer_use",
        status="completed",
        reward=1.0,
        turns=[
            Turn(index=0, prompt_token_ids=ids[:4], completion_token_ids=[5], images=first),
            Turn(index=1, prompt_token_ids=ids[:7], completion_token_ids=[5], images=both),
        ],
        trajectory=Trajectory(
            input_ids=ids,
            loss_mask=[0] * 7 + [1],
            logprobs=[None] * 7 + [-0.1],
            policy_versions=[None] * 7 + [0],
            images=both,
        ),
    )


async def test_a_files_journal_writes_each_distinct_image_once_and_its_lines_name_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "results.jsonl"
    pngs = [b"\x89PNG one", b"\x89PNG two"]
    originals = [result(n, pngs) for n in range(3)]
    async with anyio.create_task_group() as tg, Journal(path, tg, images="files") as journal:
        kept = [journal.append(r) for r in originals]
    # What the journal hands back keeps its bytes: only the disk differs.
    assert kept == originals
    folder = images_folder(path)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"{hashlib.sha256(png).hexdigest()}.png" for png in pngs
    )
    for png in pngs:
        assert (folder / f"{hashlib.sha256(png).hexdigest()}.png").read_bytes() == png
    line = json.loads(path.read_text().splitlines()[0])
    stored = line["turns"][1]["images"][1]
    assert "data" not in stored
    assert stored["path"] == f"results.jsonl.images/{hashlib.sha256(pngs[1]).hexdigest()}.png"
    assert stored["nbytes"] == len(pngs[1])
    assert "data" not in line["trajectory"]["images"][0]
    read = read_journal(path)
    assert [inline_images(r, path.parent) for r in read] == originals
    # A trainer's rows name the files; row_images reads them back, checked.
    rows = training_rows([read], group_size=3)
    assert all(row_images(row, journal=path) == pngs for row in rows)
    with pytest.raises(ValueError, match="journal"):
        row_images(rows[0])


async def test_an_inline_journal_keeps_the_bytes_in_its_lines(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    original = result(0, [b"\x89PNG one"])
    async with anyio.create_task_group() as tg, Journal(path, tg) as journal:
        journal.append(original)
    assert not images_folder(path).exists()
    assert read_journal(path) == [original]
    (row,) = training_rows([read_journal(path)], group_size=1)
    assert row_images(row) == [b"\x89PNG one"]


def test_a_file_whose_bytes_are_not_its_images_is_refused(tmp_path: Path) -> None:
    png = b"\x89PNG one"
    sha = hashlib.sha256(png).hexdigest()
    (tmp_path / "x.png").write_bytes(b"something else")
    stored = TurnImage(start=0, end=2, width=56, height=28, sha256=sha, path="x.png", nbytes=8)
    with pytest.raises(ValueError, match="not the image's"):
        stored.png(tmp_path)
    with pytest.raises(ValueError, match="either"):
        TurnImage(start=0, end=2, width=56, height=28, sha256=sha)


def test_references_are_rebased_for_a_results_file_in_another_folder(tmp_path: Path) -> None:
    png = b"\x89PNG one"
    sha = hashlib.sha256(png).hexdigest()
    (tmp_path / "run" / "r.jsonl.images").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "run" / "r.jsonl.images" / f"{sha}.png").write_bytes(png)
    stored = TurnImage(
        start=0, end=2, width=56, height=28, sha256=sha, path=f"r.jsonl.images/{sha}.png"
    )
    one = result(0, [png]).model_copy(update={"turns": [Turn(index=0, images=[stored])]})
    moved = rebased_images(one, tmp_path / "run", tmp_path / "out")
    (turn,) = moved.turns
    assert turn.images is not None
    assert turn.images[0].path == f"../run/r.jsonl.images/{sha}.png"
    assert turn.images[0].png(tmp_path / "out") == png
