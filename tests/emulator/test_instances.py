"""Instances end on time and are forgotten in time: a long-lived emulator stays bounded."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest
from fleet._async.exceptions import FleetAPIError

from fleetroll.emulator import Emulator, FaultProfile, Latency, Ledger
from fleetroll.emulator.envs.ledger import LedgerEnv
from fleetroll.emulator.instances import Instance, InstanceStore


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def test_ended_instances_past_the_kept_count_are_forgotten_with_their_files(sdk) -> None:
    async with Emulator(keep_ended_instances=3, keep_ended_s=3600) as emu:
        fleet = sdk(emu)
        ids = []
        for _ in range(25):
            env = await fleet.make("ledger")
            ids.append(env.instance_id)
            await env.close()
        assert len(emu.store) == 3
        assert files(emu.store.data_dir) == sorted(f"{i}.db" for i in ids[-3:])
        assert (await fleet.instance(ids[-1])).status == "stopped"  # a late read still works
        with pytest.raises(FleetAPIError):
            await fleet.instance(ids[0])
        assert emu.ledger.created == emu.ledger.deleted == 25 and emu.ledger.running == 0


async def test_ended_instances_past_the_kept_age_are_forgotten_with_their_files(sdk) -> None:
    async with Emulator(keep_ended_instances=1000, keep_ended_s=0) as emu:
        fleet = sdk(emu)
        alive = await fleet.make("ledger")
        for _ in range(5):
            await (await fleet.make("ledger")).close()
        assert [i.instance_id for i in emu.store] == [alive.instance_id]
        assert files(emu.store.data_dir) == [f"{alive.instance_id}.db"]
        await alive.close()
        assert len(emu.store) == 0 and files(emu.store.data_dir) == []


async def test_the_reaper_ends_an_instance_at_its_deadline_with_nobody_asking(
    sdk, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = FaultProfile(p_instance_death=1.0, death_after=Latency(min_s=0.2, max_s=0.2))
    async with Emulator(profile) as emu:
        ended = anyio.Event()
        count = emu.ledger.instance_ended

        def observed(how: str) -> None:
            count(how)
            ended.set()

        monkeypatch.setattr(emu.ledger, "instance_ended", observed)
        await sdk(emu).make("ledger")
        with anyio.fail_after(30):
            await ended.wait()
        assert emu.ledger.died == 1 and emu.ledger.running == 0


def make(store: InstanceStore, *, ttl_s: float | None, heartbeat: int | None = None) -> Instance:
    return store.create(
        LedgerEnv(),
        version="v1",
        data_key=None,
        data_version=None,
        region="r",
        run_id=None,
        env_variables=None,
        image_type=None,
        ttl_s=ttl_s,
        dies_after_s=None,
        heartbeat_interval=heartbeat,
    )


def test_the_store_wakes_for_the_earliest_deadline_and_ends_only_what_is_due(
    tmp_path: Path,
) -> None:
    store = InstanceStore(tmp_path, Ledger(), keep_ended=10, keep_ended_s=1000)
    wakes: list[None] = []
    store.on_earlier_deadline = lambda: wakes.append(None)
    forever = [make(store, ttl_s=None) for _ in range(50)]
    assert store.next_deadline() is None and wakes == []  # nothing to wait for
    late = make(store, ttl_s=20)
    soon = make(store, ttl_s=10)
    assert len(wakes) == 2
    assert store.next_deadline() == soon.created_mono + 10

    store.expire_due(now=soon.created_mono + 10)
    assert not soon.alive and late.alive and all(i.alive for i in forever)
    # Next: the other TTL, unless forgetting the ended one comes first.
    assert store.next_deadline() == late.created_mono + 20
    store.close()


def test_a_heartbeat_moves_the_deadline_and_missed_ones_end_the_instance(tmp_path: Path) -> None:
    store = InstanceStore(tmp_path, Ledger())
    inst = make(store, ttl_s=None, heartbeat=5)
    assert store.next_deadline() is None  # heartbeats count from the first one
    store.heartbeat(inst)
    assert inst.last_heartbeat_mono is not None
    first = inst.last_heartbeat_mono + 10
    assert store.next_deadline() == first
    store.expire_due(now=first - 1)
    assert inst.alive
    store.expire_due(now=first)
    assert not inst.alive
    store.close()


def test_deadlines_of_deleted_instances_do_not_pile_up(tmp_path: Path) -> None:
    store = InstanceStore(tmp_path, Ledger(), keep_ended=0)
    for _ in range(500):
        store.delete(make(store, ttl_s=3600))
    assert len(store) == 0 and files(tmp_path) == []
    assert len(store._deadlines) <= 64 + 1
    store.close()


def test_heartbeats_do_not_pile_up_deadlines(tmp_path: Path) -> None:
    store = InstanceStore(tmp_path, Ledger())
    beating = [make(store, ttl_s=None, heartbeat=30) for _ in range(10)]
    for _ in range(100):
        for inst in beating:
            store.heartbeat(inst)
    assert len(store._deadlines) <= 2 * len(beating) + 64 + 1
    store.close()


def test_every_instance_and_every_reseed_starts_from_the_seed_not_from_another_instance(
    tmp_path: Path,
) -> None:
    store = InstanceStore(tmp_path, Ledger())
    first = make(store, ttl_s=None)
    seeded = first.conn.execute("SELECT name, balance_cents FROM accounts").fetchall()
    first.conn.execute("UPDATE accounts SET balance_cents = 1")
    first.conn.execute("INSERT INTO accounts (name, kind, balance_cents) VALUES ('X', 'asset', 2)")
    second = make(store, ttl_s=None)
    assert second.conn.execute("SELECT name, balance_cents FROM accounts").fetchall() == seeded
    store.reseed(first)
    assert first.conn.execute("SELECT name, balance_cents FROM accounts").fetchall() == seeded
    # The verifier reads the file, not our connection: the copy is on disk.
    assert first.db_path.stat().st_size > 0
    store.close()


def test_a_seeded_time_pinned_reseed_gives_the_same_random_draws_and_clock_every_time(
    tmp_path: Path,
) -> None:
    store = InstanceStore(tmp_path, Ledger())
    inst = make(store, ttl_s=None)

    def after_reset(**point: int | None) -> tuple[list[int], str, str]:
        store.reseed(inst, **point)
        [(now,)] = inst.conn.execute("SELECT fleet_now()").fetchall()
        return [inst.rng.getrandbits(32) for _ in range(3)], inst.now().isoformat(), now

    pinned = after_reset(seed=7, timestamp=1_767_225_600)
    assert after_reset(seed=7, timestamp=1_767_225_600) == pinned
    assert pinned[1:] == ("2026-01-01T00:00:00+00:00", "2026-01-01T00:00:00+00:00")
    assert (inst.seed, inst.timestamp) == (7, 1_767_225_600)
    assert after_reset(seed=8, timestamp=1_767_225_600)[0] != pinned[0]
    unpinned = after_reset()
    assert (inst.seed, inst.timestamp) == (None, None) and unpinned[1] != pinned[1]
    store.close()


async def test_a_reset_request_that_is_not_fleet_s_reset_request_is_refused(sdk) -> None:
    async with Emulator() as emu:
        env = await sdk(emu).make("ledger")
        url = f"{env.urls.manager.api}/reset"
        async with httpx.AsyncClient() as client:
            bad = await client.post(url, json={"seed": "seven", "timestamp": None})
            none = await client.post(url)  # no body: neither a seed nor a time
        assert bad.status_code == 422 and "Invalid reset request" in bad.text
        assert none.json()["success"] is True
        assert (await env.reset(seed=3, timestamp=1_767_225_600)).success
        assert emu.ledger.resets == 2 and emu.ledger.resets_seeded == 1
        await env.close()
