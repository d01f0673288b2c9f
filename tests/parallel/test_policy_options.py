"""Each sync policy names the DataParallelPipelines options it takes."""

import pytest

from jpipe import parallel
from jpipe.parallel._sync import policy_options

ARGUMENTS = dict(ssp_bound=3, pairwise=True, gossip_seed=7, hetpipe_every=5)


@pytest.mark.parametrize(
  "name, expected",
  [
    ("allreduce", {}),
    ("preduce", {"ssp_bound": 3, "pairwise": True}),
    ("adpsgd", {"seed": 7}),
    ("hetpipe", {"every": 5}),
  ],
)
def test_a_policy_takes_its_own_options(name, expected):
  options = policy_options(name, **ARGUMENTS)
  assert options == expected
  policy = parallel.make_policy(name, 2, 1, 10, **options)
  kept = {"ssp_bound": lambda p: p.schedulers[0].rounds.ssp_bound}
  for key, value in expected.items():
    read = kept.get(key, lambda p, key=key: getattr(p, key))
    assert read(policy) == value


def test_an_unknown_policy_is_refused_naming_the_choices():
  with pytest.raises(ValueError, match="unknown sync policy 'ring'.*hetpipe"):
    policy_options("ring", **ARGUMENTS)


def test_policies_without_a_server_keep_the_params_they_finish_with():
  # DataParallelPipelines keeps a drained state as it is when every
  # stage's params come back unchanged (no stream restart).
  for name in ("allreduce", "preduce", "adpsgd"):
    policy = parallel.make_policy(name, 2, 1, 10)
    policy.start(((1.0,),))  # Nothing to serve.
    params = (1.0, 2.0)
    assert policy.finish(0, 0, params) is params
