from arctic_rl.rollout.engines.ray.pool import balance_prompts


def test_groups_stay_whole_and_tokens_balance():
    lengths = [100, 10, 10, 10, 50, 40]  # costs with G=4, 5 new tokens: 120, 30, 30, 30, 70, 60
    plan = balance_prompts(lengths, samples_per_prompt=4, max_new_tokens=5, num_engines=2)
    assert sorted(i for part in plan for i in part) == list(range(6))  # each prompt exactly once
    assert plan == [[0, 1, 3], [2, 4, 5]]  # longest first to the least loaded: loads 180 and 160
    assert balance_prompts([5], 4, 5, 3) == [[0], [], []]
