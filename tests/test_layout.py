"""lm_jax.layout: the one builder of a run's layout, which the trainer, --mode=compile and the memory estimate share."""
import jax
from jax.sharding import AbstractMesh

from lm_jax import layout, sharding, train
from lm_jax.plan import memory
from conftest import load_config


def test_a_trainer_start_builds_the_layout_once(shared_data, tmp_path, monkeypatch):
  built = []
  real = layout.build

  def counting(*args, **kwargs):
    built.append(args[0].objective)
    return real(*args, **kwargs)
  monkeypatch.setattr(layout, "build", counting)
  result = train.train(load_config("clm", shared_data, total_steps=2, eval_every=0), str(tmp_path))
  assert result["step"] == 2
  assert built == ["clm"]   # setup's; the first step's memory line reuses it


def test_the_estimate_of_a_built_layout_equals_a_planned_one(shared_data):
  config = load_config("mlm", shared_data)
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  built = memory.estimate(config, layout=layout.build(config, mesh))
  planned = memory.estimate(config, mesh=(1, 1, 1))
  assert built == planned and built.params > 0 and built.opt_state > 0


def test_the_layout_plans_a_mesh_this_host_does_not_have(shared_data):
  config = load_config("clm", shared_data, **{"mesh.fsdp": 16})
  lay = layout.build(config, AbstractMesh((1, 16, 1), sharding.AXES))
  params, shardings = lay.abstract_state["params"], lay.state_sharding["params"]
  split = [a.shape for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings))
           if s.shard_shape(a.shape) != a.shape]
  assert split   # parameters split 16 ways, though this host has one device
  assert all(s.mesh.shape["fsdp"] == 16 for s in jax.tree.leaves(shardings))
