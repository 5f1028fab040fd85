"""The resume rule between the two checkpoint tiers, as pure logic
(``hpctrain.train.checkpointing.choose_local``): the local tier's agreed
step replaces what the persistent tier gave only when it is newer, and every
reason it is not used is said."""
from hpctrain.localckpt.tier import Found
from hpctrain.train.checkpointing import choose_local

WHERE = "/local/ckpt"


def test_a_newer_complete_local_step_is_used():
    choice = choose_local(Found(8, {}, None), step_now=6, where=WHERE)
    assert choice.use and choice.notes == []


def test_a_local_step_not_newer_than_the_persistent_one_is_not_used():
    for step_now in (8, 10):
        choice = choose_local(Found(8, {}, None), step_now=step_now, where=WHERE)
        assert not choice.use
        assert choice.notes == [f"local tier ({WHERE}): its newest complete step 8 is not newer than the persistent "
                                f"checkpoint's step {step_now}; using the persistent checkpoint"]


def test_a_fresh_start_takes_any_complete_local_step():
    assert choose_local(Found(2, {}, None), step_now=0, where=WHERE).use


def test_nothing_held_for_every_rank_falls_back():
    choice = choose_local(Found(None, {}, None), step_now=4, where=WHERE)
    assert not choice.use
    assert choice.notes == [f"local tier ({WHERE}): no step that every rank's state is held for"]


def test_another_layouts_steps_are_named_and_not_used():
    choice = choose_local(Found(None, {}, other_layout=12), step_now=4, where=WHERE)
    assert not choice.use
    assert choice.notes[0] == (f"local tier ({WHERE}): step 12 was written by another layout or experiment; not "
                               "used, falling back to the persistent checkpoint")
    # a usable older step of this layout still wins over the persistent one when newer
    choice = choose_local(Found(6, {}, other_layout=12), step_now=4, where=WHERE)
    assert choice.use and "step 12 was written by another layout" in choice.notes[0]


def test_a_refused_reshard_is_explained():
    choice = choose_local(Found(None, {}, 10, refused="step 10: tp changed"), step_now=0, where=WHERE)
    assert not choice.use
    assert choice.notes[0] == (f"local tier ({WHERE}): step 10: tp changed; trainer.elastic=true reshards the local "
                               "tier over dp only, so this step is not used")
