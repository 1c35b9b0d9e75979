"""verifiers environments for tests, each a taskset module as ``verifiers`` loads them
(``env.name: verifiers:tests.helpers.vf.<module>``), written with the package's own classes."""
