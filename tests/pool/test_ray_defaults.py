"""How many Ray actors ``--ray`` starts when nobody says: one per CPU (no Ray started here)."""

from __future__ import annotations

import os

import click
from click.testing import CliRunner

from fleetroll.cli.options import ray_options
from fleetroll.pool.ray.actors import default_num_actors
from fleetroll.pool.ray.executor import planned_actors


def test_the_default_actor_count_is_the_number_of_cpus_this_process_may_use() -> None:
    assert default_num_actors() == len(os.sched_getaffinity(0))


def test_a_ray_pool_given_no_actor_count_plans_one_per_cpu() -> None:
    assert planned_actors(None) == default_num_actors()


def test_a_ray_pool_joining_a_cluster_plans_one_per_cpu_of_the_cluster() -> None:
    assert planned_actors(None, cluster_cpus=16) == 16


def test_an_explicit_actor_count_overrides_the_default() -> None:
    assert planned_actors(3) == 3 and planned_actors(3, cluster_cpus=16) == 3


def test_the_ray_actors_option_is_unset_unless_given_so_the_pool_decides() -> None:
    seen: list[int | None] = []

    @click.command()
    @ray_options
    def command(ray_address: str | None, ray_actors: int | None) -> None:
        seen.append(ray_actors)

    runner = CliRunner()
    assert runner.invoke(command, ["--ray"]).exit_code == 0
    assert runner.invoke(command, ["--ray", "--ray-actors", "5"]).exit_code == 0
    assert seen == [None, 5]
