"""What the search box makes of what people type: ``portal.messaging.records.search``
reads text into terms without touching the database."""

from __future__ import annotations

import pytest

from portal.messaging.records import search


@pytest.mark.parametrize(
    ("typed", "country", "said"),
    [
        ("07911 123456", "GB", "phone number +447911123456 (GB)"),
        ("030 1234567", "DE", "phone number +49301234567 (DE)"),
        ("447911123456", "US", "phone number +447911123456"),
        ("+44 7911 123456", "DE", "phone number +447911123456"),
        ("0044 7911 123456", "DE", "phone number +447911123456"),
        ("Invoice", "GB", "mail subject containing “Invoice”"),
        ("carol@", "GB", "an address starting with “carol@”"),
        ("@example.com", "GB", "an address at example.com"),
        ("Carol@Example.com", "GB", "email address carol@example.com"),
        ("<mail-42@example.com>", "GB", "Message-ID <mail-42@example.com>"),
        ("42", "GB", "record id 42"),
        ("order-77", "GB", "business key “order-77”"),
    ],
)
def test_the_text_is_read_as_people_mean_it(typed: str, country: str, said: str) -> None:
    assert said in search.interpret(typed, country).description


def test_country_codes_are_checked() -> None:
    assert search.country_code(" de ") == "DE"
    assert search.country_code("") is None
    with pytest.raises(ValueError, match="ISO 3166"):
        search.country_code("XX")


def test_a_long_or_empty_text_reads_as_nothing_it_cannot_be() -> None:
    assert search.interpret("   ", "GB").terms == ()
    assert search.interpret("1" * 25, "GB").of(search.TermKind.RECORD_ID) == []
    # Words with spaces are a subject only: no address, key or id is ever spelled so.
    meaning = search.interpret("Invoice March", "GB")
    assert [t.kind for t in meaning.terms] == [search.TermKind.SUBJECT]


@pytest.mark.parametrize(
    ("typed", "word"),
    [
        ("Invoice", None),  # one word: the trigram index gets the whole text, as before
        ("order 424242 is", "424242"),  # the number, not the words every subject has
        ("order-424242", "424242"),  # a business key typed in the box: its subject reading
        ("your invoice INV20241105", "INV20241105"),
        ("INV20241105", None),  # the word is the whole text
        ("welcome aboard", None),  # no identifier: the whole text
        ("invoice 2024", None),  # a year is no identifier (too common to check one by one)
        ("order 4242 is", "4242"),  # a 4-digit number that is not a year is one
        ("order 424 is", None),  # shorter numbers are not
        ("john.smith1984", "smith1984"),
        ("a big 50% off", None),
    ],
)
def test_the_index_looks_up_the_identifier_in_a_search(typed: str, word: str | None) -> None:
    assert search.index_word(typed) == word


@pytest.mark.parametrize(
    ("typed", "core"),
    [
        ("user4242", "er4242"),  # "use" and "ser" are in nearly every address
        ("john.smith1984", "th1984"),
        ("INV20241105", "NV20241105"),
        ("4242a", "4242a"),
        ("a1b2c3d", "a1b2c3d"),
        ("carol", None),  # no digit: the whole part, as before
        ("ab12", None),  # too short to be an identifier
        ("example.com", None),
    ],
)
def test_an_address_part_gives_the_index_the_stretch_around_its_digits(
    typed: str, core: str | None
) -> None:
    assert search.rare_core(typed) == core
