"""kill -9 inside a checkpoint save and inside a training step, then resume: the bounded version of
tests/checkpoint_faults.py (its small ``mlp`` target: bf16 split weights, int8 optimizer state, step_in_backward),
whose full runs (the LLM fine-tune recipe, 2-rank FSDP2) are reported in docs/checkpoints.md. Only processes this
test starts (each in a session of its own) are killed. ~40-60 s."""
import checkpoint_faults as F


def test_kill_inside_a_save_and_inside_a_step_then_resume(tmp_path):
    # Each save waits 0.5 s between DCP's last write (.metadata) and its publication: the kill inside the save
    # lands there (a folder with every file and the metadata, but no marker and not renamed).
    report = F.run("mlp", kills=2, steps=12, every=4, seed=1, work=tmp_path, publish_delay=0.5)
    modes = [t["mode"] for t in report["trials"]]
    assert modes == ["in_save", "in_step"], modes
    for t in report["trials"]:
        assert t["killed"] and t["trigger_seen"], t
        assert t["resumed_step"] == t["expected_resume_step"], t
        assert t["resumed_folder_was_complete"], t
        assert t["losses_from_resumed_step_equal"], t
        assert t["final_weights_bit_identical"] and t["final_optimizer_state_bit_identical"], t
    # The kill inside the save left its unfinished folder, which the resume did not take.
    inside = report["trials"][0]
    assert inside["killed_inside_save"], inside
    assert (inside["folders_at_kill"][f"step-{inside['k']}.tmp"]) is False
    assert inside["resumed_step"] < inside["k"], inside
