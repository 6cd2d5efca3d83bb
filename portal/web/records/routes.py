"""A channel's record pages, made from the channel: its ``Kind`` (``records_kind``: what the
channel itself names, and the module's own words), and the views both channels' pages have
(``add_routes``, as ``config_pages`` and ``template_pages`` make the configuration pages'): the
list, Retry and Resend of one record, and bulk retry and cancel. Each channel's module
(``mail_records``, ``sms_records``) adds its own record page."""

from __future__ import annotations

from flask import Blueprint
from flask.typing import ResponseReturnValue

from portal.messaging.records.retry import Model
from portal.models import (
    Channel,
    MailSendRecord,
    MailSendServerConfig,
    SmsProviderConfig,
    SmsSendRecord,
)
from portal.web.access import Permission, requires
from portal.web.records.bulk_cancel import bulk_cancel_view
from portal.web.records.bulk_retry import bulk_retry_view
from portal.web.records.kind import Kind
from portal.web.records.listing import index_view
from portal.web.records.record_page import resend_one, retry_one
from portal.web.records.search_box import channel_search

# Each channel's records, the servers or providers they go through, and the word for it.
_CHANNELS: dict[
    Channel, tuple[Model, type[MailSendServerConfig] | type[SmsProviderConfig], str]
] = {
    Channel.MAIL: (MailSendRecord, MailSendServerConfig, "mail"),
    Channel.SMS: (SmsSendRecord, SmsProviderConfig, "SMS"),
}


def records_kind(
    channel: Channel,
    *,
    noun: str,
    search_label: str,
    search_hint: str,
    preview_heading: str,
    list_columns: tuple[str, ...],
) -> Kind:
    """The channel's record pages: what the channel names (their blueprint, model, configs,
    title and search box) and the words and columns its module gives."""
    model, config, word = _CHANNELS[channel]
    return Kind(
        blueprint=f"{channel.value}_records",
        model=model,
        channel=channel,
        config=config,
        platform_service=f"platform {word} service",
        title=f"{word[:1].upper()}{word[1:]} records",
        noun=noun,
        search_label=search_label,
        search_hint=search_hint,
        preview_heading=preview_heading,
        search=channel_search(channel),
        list_columns=list_columns,
    )


def add_routes(bp: Blueprint, kind: Kind) -> None:
    """The views every channel's record pages have, on its blueprint."""

    def index() -> ResponseReturnValue:
        """The records, newest first: search, filters, keyset pages."""
        return index_view(kind)

    def retry(record_id: int) -> ResponseReturnValue:
        """Requeue one record (Pending, Retry, Failed, DeadLetter): due now, claimed by
        version."""
        return retry_one(kind, record_id)

    def resend(record_id: int) -> ResponseReturnValue:
        """Send an uncertain record again as a new message, after a confirm page."""
        return resend_one(kind, record_id)

    def bulk_retry() -> ResponseReturnValue:
        """Retry selected records or all matching the filter: confirm with counts, then
        requeue."""
        return bulk_retry_view(kind)

    def bulk_cancel() -> ResponseReturnValue:
        """Cancel selected records or all matching the filter that are still queued, by
        version."""
        return bulk_cancel_view(kind)

    may_retry = requires(Permission.RETRY)
    bp.add_url_rule("/", "index", requires(Permission.VIEW_RECORDS)(index), methods=["GET"])
    bp.add_url_rule("/<int:record_id>/retry", "retry", may_retry(retry), methods=["POST"])
    # Resending is a decision on an uncertain outcome, as Resolve is.
    resolve = requires(Permission.RESOLVE)
    bp.add_url_rule("/<int:record_id>/resend", "resend", resolve(resend), methods=["POST"])
    bp.add_url_rule("/retry", "bulk_retry", may_retry(bulk_retry), methods=["POST"])
    # As the record page's Cancel: whoever may retry may cancel.
    bp.add_url_rule("/cancel", "bulk_cancel", may_retry(bulk_cancel), methods=["POST"])
