"""Decode-round walk of the simulated acceptance (``simulate.serving_rounds``)."""

from specforge_kimi.evaluate.simulate import serving_rounds

F, T = False, True


def test_rounds_start_after_the_prompt_and_advance_by_each_rounds_tokens():
    # prompt 0-1, generated 2-9: the prefill emits token 2, the first round drafts after t=1
    trained = [F, F, T, T, T, T, T, T, T, T]
    length = [9, 3, 9, 9, 4, 9, 9, 9, 2, 9]  # 9s are chains no round starts at
    assert serving_rounds(length, trained) == [3, 4]  # t=1 -> 4 -> 8 (8+2 > 9: nothing left to draft)


def test_each_generated_run_is_walked_on_its_own():
    trained = [F, T, T, T, T, F, F, T, T, T, T, T]
    length = [2, 1, 1, 9, 9, 9, 1, 1, 3, 9, 9, 9]
    # run 1-4: t=0 (2) -> 2 (1) -> 3 (3+2 > 4: stop); run 7-11: t=6 (1) -> 7 (1) -> 8 (3) -> 11 stop
    assert serving_rounds(length, trained) == [2, 1, 1, 1, 3]


def test_rounds_cover_at_most_the_generated_tokens_and_never_stall():
    import random

    rng = random.Random(0)
    for _ in range(200):
        L = rng.randint(3, 40)
        trained = [F] + [rng.random() < 0.8 for _ in range(L - 1)]
        length = []
        for t in range(L):  # as simulated_acceptance counts: accepted drafts are generated tokens
            run = 0
            while t + 2 + run < L and trained[t + 2 + run] and run < 3:
                run += 1
            length.append(rng.choice([0, 1 + rng.randint(0, run)]))  # 0 is clamped to 1: rounds advance
        rounds = serving_rounds(length, trained)
        assert all(1 <= n <= 4 for n in rounds)
        assert sum(rounds) <= sum(trained)


def test_no_generated_tokens_no_rounds():
    assert serving_rounds([4, 4, 4], [F, F, F]) == []
    assert serving_rounds([4, 4], [F, T]) == []  # the prefill's token only: nothing to draft
