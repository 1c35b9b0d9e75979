"""The learners: plain torch, run inside Ray Train workers or in a test, never importing Ray.

One file per algorithm (``ppo``, ``dpo``, ``sft``, ``qlearn``, ``reward_model``) behind one
interface (``base.Learner``, registered in ``base.LEARNERS``), on a shared policy learner
(``policy``) and the experience record (``experience``). ``objectives`` is the pure maths
(estimators and losses, each family a registry); ``training`` what a learner trains with (the
model's passes, precision, sharding, the optimiser, the collective between ranks).
"""
