from textutil.slug import slugify


def test_simple():
    assert slugify("Hello, World!") == "hello-world"


def test_runs_and_edges():
    assert slugify("  --A  b__c--  ") == "a-b-c"


def test_digits():
    assert slugify("Route 66") == "route-66"
