"""What differs between mail and SMS, declared once: each channel's models and words.

Code that serves both channels takes a ``Channel`` and asks ``PARTS[channel]`` for the record,
configuration and template models and the words a page or a reason uses, instead of writing
``X if channel is Channel.MAIL else Y`` where it needs one. The columns the two channels share
are declared once in ``channels.py``; what only one channel has stays on its own models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import InstrumentedAttribute

from portal.models.enums import Channel
from portal.models.mail import MailSendRecord, MailSendServerConfig, MailTemplate
from portal.models.sms import SmsProviderConfig, SmsSendRecord, SmsTemplate


@dataclass(frozen=True)
class ChannelParts:
    channel: Channel
    record: type[MailSendRecord] | type[SmsSendRecord]
    config: type[MailSendServerConfig] | type[SmsProviderConfig]
    template: type[MailTemplate] | type[SmsTemplate]
    # The record's column that names the server or provider it went (or goes) through.
    route: InstrumentedAttribute[Any]
    noun: str  # "this month's {noun} quota"
    config_noun: str  # "the {config_noun} is failing"
    config_pages: str  # where its servers or providers are configured


PARTS: dict[Channel, ChannelParts] = {
    Channel.MAIL: ChannelParts(
        Channel.MAIL,
        record=MailSendRecord,
        config=MailSendServerConfig,
        template=MailTemplate,
        route=MailSendRecord.server_config_id,
        noun="mail",
        config_noun="mail server",
        config_pages="/mail-servers/",
    ),
    Channel.SMS: ChannelParts(
        Channel.SMS,
        record=SmsSendRecord,
        config=SmsProviderConfig,
        template=SmsTemplate,
        route=SmsSendRecord.provider_config_id,
        noun="SMS",
        config_noun="SMS provider",
        config_pages="/sms-providers/",
    ),
}
