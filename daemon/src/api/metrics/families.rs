//! What the families of many samples share: one family per `(name, help, value)` over rows.

use std::fmt;

use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet, NoLabelSet,
};
use prometheus_client::metrics::MetricType;

/// A family of samples: its name, its help, and each row's value.
type Family<'a, T, V> = (&'a str, &'a str, fn(&T) -> V);

/// One gauge family per `(name, help, value)`: a sample per row, labelled by `labels` (in the
/// rows' order).
pub(super) fn gauges<T, L: EncodeLabelSet, V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    rows: &[T],
    labels: &[L],
    families: &[Family<T, V>],
) -> fmt::Result {
    for (name, help, value) in families {
        let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (r, l) in rows.iter().zip(labels) {
            m.encode_family(l)?.encode_gauge(&value(r))?;
        }
    }
    Ok(())
}

/// The same for counters (the encoder adds `_total` to each name).
pub(super) fn counters<T, L: EncodeLabelSet, V: EncodeCounterValue>(
    enc: &mut DescriptorEncoder,
    rows: &[T],
    labels: &[L],
    families: &[Family<T, V>],
) -> fmt::Result {
    for (name, help, value) in families {
        let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (r, l) in rows.iter().zip(labels) {
            m.encode_family(l)?.encode_counter::<NoLabelSet, _, u64>(&value(r), None)?;
        }
    }
    Ok(())
}
