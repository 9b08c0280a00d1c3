"""The majority-class baseline and the one-class flag every accuracy is shown beside (device_runtime.baseline)."""
import numpy as np

from device_runtime.baseline import describe, majority, one_class, predicted_classes


def test_the_majority_is_the_most_common_label_and_a_tie_goes_to_the_smallest_id():
    assert majority(np.array([7, 7, 2, 7, 1])) == (7, 3)
    assert majority(np.array([4, 2, 2, 4])) == (2, 2)
    assert majority(np.array([], np.int64)) == (None, 0)


def test_a_model_is_flagged_only_when_it_answers_one_class_for_several_samples():
    assert predicted_classes(np.array([7, 7, 7])) == 1 and one_class(1, 3)
    assert not one_class(2, 3) and not one_class(1, 1) and not one_class(None, 5)


def test_the_line_puts_the_baseline_beside_the_accuracy_and_names_a_trivial_model():
    assert describe(129, 149, 129, 1) == ("129/149 correct (0.8658), majority-class baseline 0.8658: ONE CLASS "
                                          "predicted for every sample (a trivial model)")
    assert describe(120, 149, 60, 6) == "120/149 correct (0.8054), majority-class baseline 0.4027"
