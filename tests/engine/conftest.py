"""Fixtures of the paper-app modules (test_app_*.py, test_apps_all_seven.py): each module
deploys the apps on the session's engine for its model (tests/apps_oracle.py: one engine per
tiny model, artifacts derived once) and undeploys them when it ends."""

import pytest

from apps_oracle import LLAMA_APPS, MIXTRAL_APPS, deploy_env, one_thread, undeploy_env


@pytest.fixture(scope="module")
def llama(request):
    with one_thread():
        env = deploy_env("tiny-llama", request.config, LLAMA_APPS)
        yield env
        undeploy_env(env)


@pytest.fixture(scope="module")
def mixtral(request):
    with one_thread():
        env = deploy_env("tiny-mixtral", request.config, MIXTRAL_APPS)
        yield env
        undeploy_env(env)
